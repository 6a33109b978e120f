//! How many heap allocations the gateway makes per request, counted (not timed) so the check is exact on
//! any machine. The counting allocator sees this thread only: the test drives the gateway on a
//! current-thread runtime, so decode, hydrate, assemble, postprocess and encode are all counted; the
//! model run, on its session thread, is not.

mod common;

use axum::http::StatusCode;
use axum::response::Response;
use hydrant::app::Application;
use hydrant::clock::Clock;
use hydrant::decode::Format;
use hydrant::error::ApiError;
use std::time::Instant;

const REQUESTS: u64 = 200;

/// A current-thread runtime and a ready gateway on the demo store (its folder kept alive beside it).
fn demo_gateway() -> (
    tokio::runtime::Runtime,
    std::sync::Arc<hydrant::gateway::Gateway>,
    tempfile::TempDir,
) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (gw, dir) = rt.block_on(async {
        let (store, dir) = common::demo_store().await;
        let app = Application::build_with_store(common::test_config(), store, Clock::default())
            .await
            .expect("the app builds");
        let gw = app.gateway();
        // Warm start runs on this runtime too: let it finish before counting.
        let ready = async {
            while !gw.is_ready() {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), ready)
            .await
            .expect("the gateway gets ready");
        (gw, dir)
    });
    (rt, gw, dir)
}

/// Allocations per request over [`REQUESTS`] requests of `body` to model `ctr`, every key cached.
fn allocations_per_request(body: &[u8]) -> u64 {
    let (rt, gw, _dir) = demo_gateway();
    // The first request fills the cache; the rest are the hot path.
    let first = rt
        .block_on(gw.predict(
            &gw.engine("ctr").expect("ctr"),
            Format::Json,
            Format::Json,
            body,
            Instant::now(),
        ))
        .expect("predict");
    assert_eq!(first.status(), 200);
    let info = allocation_counter::measure(|| {
        rt.block_on(async {
            for _ in 0..REQUESTS {
                let resp = gw
                    .predict(
                        &gw.engine("ctr").expect("ctr"),
                        Format::Json,
                        Format::Json,
                        body,
                        Instant::now(),
                    )
                    .await
                    .expect("predict");
                assert_eq!(resp.status(), 200);
            }
        })
    });
    let n = info.count_total / REQUESTS;
    // A request that allocates nothing was not counted (it ran on another thread).
    assert!(
        n >= 5,
        "{n} allocations per request: the counter did not see the request"
    );
    n
}

/// The hot path of the load tests (1 user, 1 candidate, 2 context fields) allocates a handful of times:
/// the answer's body and headers, the hydrated rows, the reply channel; 15 when this was written. Field
/// names or keys on the heap again would add four or more.
#[test]
fn a_cached_predict_allocates_a_handful_of_times() {
    let body = br#"{"entities": {"user_id": "u_42"}, "context": {"hour_of_day": 13, "device": "ios"}, "candidates": [{"item_id": "i_7"}]}"#;
    let n = allocations_per_request(body);
    assert!(n <= 17, "{n} allocations per hot-path request");
}

/// A ranking request's cost must not grow by an allocation or more per candidate: 100 candidates stay
/// within a few dozen allocations in all (one per candidate would be over a hundred).
#[test]
fn a_ranking_request_does_not_allocate_per_candidate() {
    let candidates: Vec<String> = (0..100)
        .map(|i| format!(r#"{{"item_id": "i_{}"}}"#, i % 20))
        .collect();
    let body = format!(
        r#"{{"entities": {{"user_id": "u_42"}}, "context": {{"hour_of_day": 13, "device": "ios"}}, "candidates": [{}]}}"#,
        candidates.join(",")
    );
    let n = allocations_per_request(body.as_bytes());
    assert!(n <= 40, "{n} allocations per 100-candidate request");
}

/// Runs `call`, a request that must be refused, under the allocation counter: the refusal's status and
/// message, and the most bytes held at once while it ran.
fn refused(call: impl FnOnce() -> Result<StatusCode, (StatusCode, String)>) -> (u16, String, u64) {
    let mut result = None;
    let info = allocation_counter::measure(|| result = Some(call()));
    match result {
        Some(Err((status, message))) => (status.as_u16(), message, info.bytes_max),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// A gateway answer as [`refused`] takes it.
fn outcome(r: Result<Response, ApiError>) -> Result<StatusCode, (StatusCode, String)> {
    r.map(|resp| resp.status())
        .map_err(|e| (e.status(), e.to_string()))
}

/// A body of many empty candidates (`{},`: three bytes each, some 200 in memory each if held) is refused
/// with the list's true length, holding no more than `limits.max_candidates` of them on the way: the
/// 1 MiB body used to take some 70 MB to read.
#[test]
fn a_list_of_candidates_past_the_limit_is_refused_without_holding_it() {
    let (rt, gw, _dir) = demo_gateway();
    let n = 300_000;
    for body in [
        // Read by hand, then by serde once past the limit.
        format!(
            r#"{{"entities": {{"user_id": "u_42"}}, "candidates": [{}]}}"#,
            vec!["{}"; n].join(",")
        ),
        // Read by serde from the start (an escape the hand reader leaves to it).
        format!(
            r#"{{"entities": {{"user_id": "u\u0034"}}, "candidates": [{}]}}"#,
            vec!["{}"; n].join(",")
        ),
    ] {
        let engine = gw.engine("ctr").expect("ctr");
        let (status, message, held) = refused(|| {
            outcome(rt.block_on(gw.predict(
                &engine,
                Format::Json,
                Format::Json,
                body.as_bytes(),
                Instant::now(),
            )))
        });
        assert_eq!(status, 413, "{message}");
        assert!(
            message.contains(&format!("{n} candidates, the limit is 1000")),
            "{message}"
        );
        assert!(
            held < 4 << 20,
            "{held} bytes held at most while refusing the list"
        );
    }
}

/// Entity keys past `limits.max_entities` are counted, not held, on each route that reads key lists:
/// the 413 names their true number, and a 1 MiB body of short keys (`"a",`: four bytes each, 24 or more
/// in memory) used to take some 20 MB more to read.
#[test]
fn entity_keys_past_the_limit_are_refused_without_holding_them() {
    let (rt, gw, _dir) = demo_gateway();
    let n = 250_000;
    let keys = vec!["\"a\""; n].join(",");
    let features =
        format!(r#"{{"features": ["user_profile"], "entities": {{"user_id": [{keys}]}}}}"#);
    // Two lists share the limit: 1 + n keys in all.
    let online = format!(
        r#"{{"features": ["user_profile:age"], "entities": {{"item_id": ["i_1"], "user_id": [{keys}]}}}}"#
    );
    let prefetch = format!(r#"{{"entities": {{"user_id": [{keys}]}}}}"#);
    for (route, body, total) in [
        ("/v1/features", &features, n),
        ("/get-online-features", &online, n + 1),
        ("/v1/prefetch", &prefetch, n),
    ] {
        let body = body.as_bytes();
        let (status, message, held) = refused(|| {
            outcome(rt.block_on(async {
                match route {
                    "/v1/features" => {
                        gw.features(Format::Json, Format::Json, body, Instant::now())
                            .await
                    }
                    "/get-online-features" => {
                        gw.online_features(Format::Json, Format::Json, body, Instant::now())
                            .await
                    }
                    _ => gw.prefetch(Format::Json, body).await,
                }
            }))
        });
        assert_eq!(status, 413, "{route}: {message}");
        assert!(
            message.contains(&format!("{total} keys, the limit is 1000")),
            "{route}: {message}"
        );
        assert!(
            held < 4 << 20,
            "{route}: {held} bytes held at most while refusing the keys"
        );
    }
}

/// An infer request's `data` is read into float32 as it streams, holding no more numbers than the largest
/// shape allowed needs: a 1 MiB list of numbers (`0,`: two bytes each) used to be held as JSON values,
/// some 40 bytes each, before its shape was checked.
#[test]
fn infer_data_past_the_largest_shape_is_refused_without_holding_it() {
    let (rt, gw, _dir) = demo_gateway();
    let n = 500_000;
    let body = format!(
        r#"{{"inputs": [{{"name": "features", "shape": [1, 27], "datatype": "FP32", "data": [{}]}}]}}"#,
        vec!["0"; n].join(",")
    );
    let engine = gw.engine("ctr").expect("ctr");
    let (status, message, held) = refused(|| {
        rt.block_on(hydrant::oip::infer(
            &gw,
            &engine,
            body.as_bytes(),
            Instant::now(),
        ))
        .map(|resp| resp.status())
        .map_err(|e| (e.0, e.1))
    });
    assert_eq!(status, 400, "{message}");
    assert!(
        message.contains("more elements than the shape's 27"),
        "{message}"
    );
    // Capped, at most 1,000 rows of 27 float32 (108 KB); uncapped, 2 MB as float32, more as JSON values.
    assert!(
        held < 1 << 20,
        "{held} bytes held at most while refusing the data"
    );
}

/// A rows request holds at most the 1,000 rows one request may write: more are counted for the 413, not
/// kept (a row is some 80 bytes in memory, `{},` three in the body).
#[test]
fn rows_past_the_limit_are_refused_without_holding_them() {
    let (rt, gw, _dir) = demo_gateway();
    let n = 300_000;
    let body = format!(r#"{{"rows": [{}]}}"#, vec!["{}"; n].join(","));
    let (status, message, held) = refused(|| {
        outcome(rt.block_on(gw.write_rows("user_profile", Format::Json, body.as_bytes())))
    });
    assert_eq!(status, 413, "{message}");
    assert!(
        message.contains(&format!("{n} rows, the limit is 1000 per request")),
        "{message}"
    );
    // Held: at most 1,000 empty rows; all of them took some 20 MB.
    assert!(
        held < 1 << 20,
        "{held} bytes held at most while refusing the rows"
    );
}

/// MessagePack declares each list's length before its elements: a length is a claim, not bytes that back
/// it, so a few bytes that claim four billion elements, in lists nested 128 deep, are refused holding
/// memory in proportion to the body, not to the claims (16 MB for 647 bytes of nested rows before).
#[test]
fn declared_messagepack_lengths_reserve_no_memory_the_body_does_not_hold() {
    let (rt, gw, _dir) = demo_gateway();
    let huge = [0xdd, 0xff, 0xff, 0xff, 0xff];
    // {"rows": [{"age": [[[... 127 lists, each declaring 2^32 - 1 elements, then the body ends.
    let mut rows = vec![
        0x81, 0xa4, b'r', b'o', b'w', b's', 0x91, 0x81, 0xa3, b'a', b'g', b'e',
    ];
    for _ in 0..127 {
        rows.extend_from_slice(&huge);
    }
    let (status, message, held) =
        refused(|| outcome(rt.block_on(gw.write_rows("user_profile", Format::Msgpack, &rows))));
    assert_eq!(status, 400, "{message}");
    assert!(
        held < 256 << 10,
        "{held} bytes held for a {}-byte body",
        rows.len()
    );
    // {"context": {"x": [<2^32 - 1 numbers>...]}} and {"candidates": [<2^32 - 1 objects>...]}.
    let mut context = vec![0x81, 0xa7];
    context.extend_from_slice(b"context");
    context.extend_from_slice(&[0x81, 0xa1, b'x']);
    context.extend_from_slice(&huge);
    let mut candidates = vec![0x81, 0xaa];
    candidates.extend_from_slice(b"candidates");
    candidates.extend_from_slice(&huge);
    for body in [context, candidates] {
        let engine = gw.engine("ctr").expect("ctr");
        let (status, message, held) = refused(|| {
            outcome(rt.block_on(gw.predict(
                &engine,
                Format::Msgpack,
                Format::Json,
                &body,
                Instant::now(),
            )))
        });
        assert_eq!(status, 400, "{message}");
        assert!(
            held < 64 << 10,
            "{held} bytes held for a {}-byte body",
            body.len()
        );
    }
}

/// A V2 infer request whose flat `data` holds a list is refused quoting the start of that list, read
/// past and not kept: built as a JSON tree for the message, a 1 MiB list took 17 times its size.
#[test]
fn a_v2_list_where_a_number_belongs_is_quoted_in_part_and_not_held() {
    let (rt, gw, _dir) = demo_gateway();
    let engine = gw.engine("ctr").expect("ctr");
    let n = 250_000;
    let body = format!(
        r#"{{"inputs": [{{"name": "features", "shape": [1, 27], "datatype": "FP32", "data": [0, [{}]]}}]}}"#,
        vec!["0"; n].join(",")
    );
    let mut result = None;
    let info = allocation_counter::measure(|| {
        result = Some(rt.block_on(hydrant::oip::infer(
            &gw,
            &engine,
            body.as_bytes(),
            Instant::now(),
        )))
    });
    let Some(Err(hydrant::oip::OipError(status, message))) = result else {
        panic!("expected a refusal");
    };
    // The message is quoted only in part when this fails: it could be as long as the body.
    let head: String = message.chars().take(300).collect();
    assert_eq!(status, 400, "{head}");
    assert!(
        message.contains("element 1 is not a number: found [0,0,0") && message.ends_with(",…]"),
        "{head}"
    );
    assert!(message.len() < 256, "{} bytes of message", message.len());
    assert!(
        info.bytes_max < 1 << 20,
        "{} bytes held for a {}-byte body",
        info.bytes_max,
        body.len()
    );
}

/// A stored record is a claim too: a damaged one that declares four billion values is refused without
/// reserving room for them (serde's own reading of a list reserves up to 1 MiB on a declared length).
#[test]
fn a_damaged_record_is_refused_without_reserving_for_the_values_it_claims() {
    // [schema_version 1, event_ts_ms 0, values: an array declaring 2^32 - 1 elements], then the end.
    let damaged = [0x94, 0x01, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff];
    let mut result = None;
    let info = allocation_counter::measure(|| {
        result = Some(hydrant::value::Record::decode(&damaged));
    });
    let err = result.expect("ran").expect_err("a damaged record");
    assert!(err.starts_with("not a valid record"), "{err}");
    assert!(
        info.bytes_max < 16 << 10,
        "{} bytes held to refuse an {}-byte record",
        info.bytes_max,
        damaged.len()
    );
    // A whole record still reads back as written.
    let record = hydrant::value::Record {
        schema_version: 3,
        event_ts_ms: 1_700_000_000_000,
        values: vec![
            hydrant::value::Value::Int(7),
            hydrant::value::Value::Str("de".into()),
            hydrant::value::Value::Null,
        ],
        layout: 9,
    };
    assert_eq!(
        hydrant::value::Record::decode(&record.encode()).expect("decodes"),
        record
    );
}
