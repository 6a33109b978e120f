# hydrant and its load tester in one image. Build: docker build -t hydrant .
FROM rust:1.95-bookworm AS build
WORKDIR /src
RUN apt-get update -qq && apt-get install -y -qq python3 python3-pip >/dev/null
COPY . .
RUN cargo build --release --locked --bin hydrant && cargo build --release --locked -p loadtest \
 && scripts/install-ort.sh cpu /opt/ort

FROM debian:bookworm-slim
# CA certificates: a `rediss://` Redis whose certificate a public CA signed is checked against them.
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends ca-certificates >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --home /app hydrant
WORKDIR /app
COPY --from=build /src/target/release/hydrant /src/target/release/loadtest /usr/local/bin/
COPY --from=build /opt/ort /opt/ort
COPY config ./config
COPY schemas ./schemas
COPY models ./models
COPY demo ./demo
COPY loadtest/scenarios ./loadtest/scenarios
# The gateway's user owns what it writes: the embedded store (data/, used when no Redis URL is set) and
# the schemas folder (`registry.writes` registers documents there).
RUN mkdir -p data && chown -R hydrant data schemas
# The image listens on every interface, so schema registration through the API is off (the demo config
# turns it on for a gateway on 127.0.0.1): set HYDRANT_REGISTRY__WRITES=true together with an
# `auth.admin_token_file` to register through the API, or mount the schemas folder and edit it.
ENV ORT_DYLIB_PATH=/opt/ort/libonnxruntime.so.1.31.1 \
    HYDRANT_SERVER__BIND=0.0.0.0:8080 \
    HYDRANT_REGISTRY__WRITES=false
USER hydrant
EXPOSE 8080
ENTRYPOINT ["hydrant"]
CMD ["serve"]
