//! The HTTP edge's one error type and its one mapping to status codes and the error body
//! `{"error": {"code", "message", "field"}}`.
//!
//! Client mistakes name the field and what was expected; internal failures answer a generic message and log
//! the full cause.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::infer::InferError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not valid JSON/MessagePack, or a field has the wrong type.
    #[error("{message}")]
    Malformed {
        code: &'static str,
        message: String,
        field: Option<String>,
    },
    /// Well-formed but not acceptable: a missing entity, an unknown context field, an empty list...
    #[error("{message}")]
    Invalid {
        code: &'static str,
        message: String,
        field: Option<String>,
    },
    #[error("{message}")]
    NotFound { code: &'static str, message: String },
    /// The route exists, not for this method; `allow` lists the ones it takes.
    #[error("{method} is not allowed on {path}: use {allow}")]
    MethodNotAllowed {
        method: String,
        path: String,
        allow: String,
    },
    #[error("{message}")]
    TooLarge {
        code: &'static str,
        message: String,
        field: Option<String>,
    },
    #[error(
        "unsupported content type `{ct}`: send `application/json` or `application/msgpack`{hint}",
        ct = .0,
        hint = form_hint(.0, "application/json")
    )]
    UnsupportedMediaType(String),
    /// More than one `Content-Type` header: which one to believe would be a guess.
    #[error("the request has more than one Content-Type header (`{0}`): send one")]
    ConflictingContentTypes(String),
    /// A `charset` other than UTF-8 in `Content-Type`.
    #[error(
        "unsupported `charset={0}` in Content-Type: hydrant reads the body as UTF-8; send it in UTF-8"
    )]
    UnsupportedCharset(String),
    #[error("unsupported `Content-Encoding: {0}`: send the body uncompressed")]
    UnsupportedEncoding(String),
    /// A transfer coding other than one `chunked` (RFC 9112 §6.1: answered 501).
    #[error(
        "unsupported `Transfer-Encoding: {0}`: send the body as is with a Content-Length, or `chunked` alone"
    )]
    UnsupportedTransferCoding(String),
    /// `Accept` refuses (`q=0`) both answer formats.
    #[error(
        "`Accept: {0}` refuses both answer formats: accept `application/json` or `application/msgpack`"
    )]
    NotAcceptable(String),
    /// Load shed: the model's queue is full.
    #[error("{0}")]
    Overloaded(String),
    /// Too many background jobs of this kind (prefetches) are running: retry later.
    #[error("{0}")]
    TooManyRequests(String),
    /// The store failed a write (a read failure degrades the answer instead).
    #[error("{0}")]
    StoreUnavailable(String),
    /// The request's deadline or the gateway's request timeout passed.
    #[error("{0}")]
    Timeout(String),
    /// The client did not send the whole body within the request timeout.
    #[error("{0}")]
    BodyTimeout(String),
    #[error("{0}")]
    NotReady(String),
    /// A schema sent to `POST /v1/schemas:validate` in a type that is not YAML (or JSON, or text).
    #[error(
        "unsupported content type `{ct}`: send the schema as `application/yaml` (`application/json` and `text/plain` are read as YAML too){hint}",
        ct = .0,
        hint = form_hint(.0, "application/yaml")
    )]
    UnsupportedSchemaType(String),
    /// A schema that fails validation (422): every problem, each with its file and path.
    #[error("{}", summary(.0))]
    InvalidSchema(crate::schema::SchemaErrors),
    /// No bearer token, or one the gateway does not know (401, with `WWW-Authenticate`).
    #[error("{message}")]
    Unauthorized {
        message: String,
        /// What RFC 6750's challenge says was wrong.
        bearer: BearerError,
    },
    /// A route turned off by configuration (registering schemas with `registry.writes = false`).
    #[error("{message}")]
    Forbidden { code: &'static str, message: String },
    /// The request conflicts with the state of the server (a schema file edited since it was loaded).
    #[error("{message}")]
    Conflict { code: &'static str, message: String },
    /// A rows write whose view changed under it in a way the rows cannot follow (409 `view_changed`);
    /// `field` names the row's feature that does not fit the new shape, where one does not.
    #[error("{message}")]
    ViewChanged {
        message: String,
        field: Option<String>,
    },
    /// The schemas folder cannot be read or written: nothing was registered.
    #[error("{0}")]
    RegistryUnwritable(String),
    /// The model scored a row as NaN or infinity (422): the stored features of the entities named are
    /// beyond what it can score.
    #[error("{message}")]
    Unscorable {
        message: String,
        field: Option<String>,
    },
    /// A bug or an unexpected failure: logged with its cause, answered generically.
    #[error("internal error: {0}")]
    Internal(String),
}

#[derive(Serialize)]
struct Body<'a> {
    error: Detail<'a>,
}

#[derive(Serialize)]
struct Detail<'a> {
    code: &'a str,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<&'a str>,
    /// An invalid schema's problems, all of them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    problems: Vec<Problem<'a>>,
}

#[derive(Serialize)]
struct Problem<'a> {
    file: String,
    path: std::borrow::Cow<'a, str>,
    message: std::borrow::Cow<'a, str>,
}

/// For a form's type, what curl users get wrong: `-d` sends `application/x-www-form-urlencoded` unless a
/// `Content-Type` is given. Empty for any other type.
pub(crate) fn form_hint(content_type: &str, send: &str) -> String {
    if crate::decode::media_essence(content_type)
        .eq_ignore_ascii_case("application/x-www-form-urlencoded")
    {
        format!(
            " (curl's `-d` sends `application/x-www-form-urlencoded` unless told otherwise: add `-H 'Content-Type: {send}'`)"
        )
    } else {
        String::new()
    }
}

/// `N schema problem(s); the first: FILE: PATH: MESSAGE`.
fn summary(errors: &crate::schema::SchemaErrors) -> String {
    match errors.0.first() {
        Some(first) => format!("{} schema problem(s); the first: {first}", errors.0.len()),
        None => "the schema is not valid".to_owned(),
    }
}

/// What a 401's `WWW-Authenticate` challenge says was wrong (RFC 6750, section 3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BearerError {
    /// No token was sent: the challenge names no error.
    Missing,
    /// The request is malformed, as one with two `Authorization` headers is: `invalid_request`.
    InvalidRequest,
    /// A token was sent and is not one of the gateway's: `invalid_token`.
    InvalidToken,
}

impl ApiError {
    pub fn invalid(
        code: &'static str,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Self::Invalid {
            code,
            message: message.into(),
            field: Some(field.into()),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::Malformed { .. } | Self::Invalid { .. } => StatusCode::BAD_REQUEST,
            Self::NotFound { .. } => StatusCode::NOT_FOUND,
            Self::Forbidden { .. } => StatusCode::FORBIDDEN,
            Self::Unauthorized { .. } => StatusCode::UNAUTHORIZED,
            Self::Conflict { .. } | Self::ViewChanged { .. } => StatusCode::CONFLICT,
            Self::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            Self::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnsupportedMediaType(_)
            | Self::UnsupportedSchemaType(_)
            | Self::ConflictingContentTypes(_)
            | Self::UnsupportedCharset(_)
            | Self::UnsupportedEncoding(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::InvalidSchema(_) | Self::Unscorable { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            Self::NotAcceptable(_) => StatusCode::NOT_ACCEPTABLE,
            Self::UnsupportedTransferCoding(_) => StatusCode::NOT_IMPLEMENTED,
            Self::TooManyRequests(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::Overloaded(_)
            | Self::Timeout(_)
            | Self::NotReady(_)
            | Self::StoreUnavailable(_)
            | Self::RegistryUnwritable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            Self::Malformed { code, .. }
            | Self::Invalid { code, .. }
            | Self::NotFound { code, .. }
            | Self::Forbidden { code, .. }
            | Self::Conflict { code, .. }
            | Self::TooLarge { code, .. } => code,
            Self::RegistryUnwritable(_) => "registry_unwritable",
            Self::ViewChanged { .. } => "view_changed",
            Self::UnsupportedMediaType(_)
            | Self::UnsupportedSchemaType(_)
            | Self::ConflictingContentTypes(_)
            | Self::UnsupportedCharset(_)
            | Self::UnsupportedEncoding(_) => "unsupported_media_type",
            Self::InvalidSchema(_) => "invalid_schema",
            Self::Unscorable { .. } => "non_finite_output",
            Self::NotAcceptable(_) => "not_acceptable",
            Self::UnsupportedTransferCoding(_) => "unsupported_transfer_coding",
            Self::Overloaded(_) => "overloaded",
            Self::TooManyRequests(_) => "too_many_requests",
            Self::StoreUnavailable(_) => "store_unavailable",
            Self::Timeout(_) => "deadline_exceeded",
            Self::BodyTimeout(_) => "body_timeout",
            Self::NotReady(_) => "not_ready",
            Self::Internal(_) => "internal",
            Self::Unauthorized { .. } => "unauthorized",
            Self::MethodNotAllowed { .. } => "method_not_allowed",
        }
    }

    fn field(&self) -> Option<&str> {
        match self {
            Self::Malformed { field, .. }
            | Self::Invalid { field, .. }
            | Self::TooLarge { field, .. }
            | Self::ViewChanged { field, .. }
            | Self::Unscorable { field, .. } => field.as_deref(),
            // The field is the request's: a first problem in a registered file has none.
            Self::InvalidSchema(errors) => errors
                .0
                .first()
                .filter(|e| e.file.as_os_str() == crate::proposal::ORIGIN && !e.path.is_empty())
                .map(|e| e.path.as_str()),
            _ => None,
        }
    }
}

impl From<InferError> for ApiError {
    fn from(e: InferError) -> Self {
        match e {
            InferError::QueueFull(_) | InferError::QueueTimeout(..) => {
                Self::Overloaded(e.to_string())
            }
            InferError::Expired(_) => Self::Timeout(e.to_string()),
            InferError::Closed(_) => Self::NotReady(e.to_string()),
            InferError::Runtime(_) | InferError::Load { .. } | InferError::Run { .. } => {
                Self::Internal(e.to_string())
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.respond(Shape::V1)
    }
}

/// The two error bodies: hydrant's own, and the Open Inference Protocol's for `/v2` paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// `{"error": {"code", "message", "field"}}`.
    V1,
    /// `{"error": "<message>"}`, as the Open Inference Protocol's REST binding answers errors.
    V2,
}

impl Shape {
    /// The shape a request to `path` is answered in.
    pub fn of_path(path: &str) -> Self {
        if path == "/v2" || path.starts_with("/v2/") {
            Self::V2
        } else {
            Self::V1
        }
    }
}

/// Longest error message and `field` sent back; longer ones are cut, saying how much was left out.
pub(crate) const MAX_MESSAGE_BYTES: usize = 4096;
const MAX_FIELD_BYTES: usize = 512;

/// The first `max` bytes of `text`, cut back to a character boundary; all of it when shorter.
pub(crate) fn head(text: &str, max: usize) -> &str {
    let mut end = max.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// `text`, or its [`head`] and `…` when it is longer than `max` bytes.
pub(crate) fn clipped(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    let kept = head(text, max);
    if kept.len() < text.len() {
        std::borrow::Cow::Owned(format!("{kept}…"))
    } else {
        std::borrow::Cow::Borrowed(text)
    }
}

/// `text`, or its first `max` bytes (at a character boundary) and how many more there were.
pub(crate) fn bounded(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return std::borrow::Cow::Borrowed(text);
    }
    let kept = head(text, max);
    std::borrow::Cow::Owned(format!("{kept}… ({} more bytes)", text.len() - kept.len()))
}

impl ApiError {
    /// The error as a response with the body of `shape`; status and headers are the same either way.
    pub fn respond(self, shape: Shape) -> Response {
        let status = self.status();
        let message = match &self {
            Self::Internal(cause) => {
                tracing::error!(cause = %cause, "internal error");
                "internal error; the cause is in the gateway's log".to_owned()
            }
            other => other.to_string(),
        };
        // A name the caller sent is echoed in the message and the field: a 1 MiB name would come back
        // two or three times over.
        let message = bounded(&message, MAX_MESSAGE_BYTES);
        let bytes = match shape {
            Shape::V1 => serde_json::to_vec(&Body {
                error: Detail {
                    code: self.code(),
                    message: &message,
                    field: self.field().map(|f| bounded(f, MAX_FIELD_BYTES)).as_deref(),
                    problems: match &self {
                        Self::InvalidSchema(errors) => errors
                            .0
                            .iter()
                            .map(|e| Problem {
                                file: e.file.display().to_string(),
                                path: bounded(&e.path, MAX_FIELD_BYTES),
                                message: bounded(&e.message, MAX_MESSAGE_BYTES),
                            })
                            .collect(),
                        _ => Vec::new(),
                    },
                },
            }),
            Shape::V2 => serde_json::to_vec(&serde_json::json!({ "error": message })),
        }
        .unwrap_or_default();
        let mut resp = (status, bytes).into_response();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        // RFC 9110, 15.5.16: a 415 for a content coding says which codings are taken.
        if let Self::UnsupportedEncoding(_) = &self {
            resp.headers_mut().insert(
                header::ACCEPT_ENCODING,
                HeaderValue::from_static("identity"),
            );
        }
        // RFC 6750: a 401 says which scheme, and whether the token sent was the problem.
        if let Self::Unauthorized { bearer, .. } = &self {
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(match bearer {
                    BearerError::Missing => "Bearer realm=\"hydrant\"",
                    BearerError::InvalidRequest => {
                        "Bearer realm=\"hydrant\", error=\"invalid_request\""
                    }
                    BearerError::InvalidToken => {
                        "Bearer realm=\"hydrant\", error=\"invalid_token\""
                    }
                }),
            );
        }
        // RFC 9110: a 405 lists the methods the resource takes (a GET route answers HEAD too).
        if let Self::MethodNotAllowed { allow, .. } = &self {
            let methods = if allow == "GET" { "GET, HEAD" } else { allow };
            if let Ok(v) = HeaderValue::from_str(methods) {
                resp.headers_mut().insert(header::ALLOW, v);
            }
        }
        resp
    }
}
