# Multi-stage build: the toolchain stays in the first stage, the image holds the binary
# and a configuration, and runs as an unprivileged user.
#   docker build -t presenced .
#   docker run --rm -p 5222:5222 presenced     # embedded: SQLite in /var/lib/presenced
#   docker run --rm -e DATABASE_URL=postgres://user:pw@db:5432/presenced \
#     -p 5222:5222 -p 5223:5223 -p 5443:5443 \
#     -v /etc/presenced/presenced.toml:/etc/presenced/presenced.toml:ro presenced
#   docker exec <container> presenced --config /etc/presenced/presenced.toml stats
#   docker kill --signal=HUP <container>     # reload (certificates, log level, limits, ...)

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin presenced

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /var/lib/presenced --create-home \
      --shell /usr/sbin/nologin presenced \
 && mkdir -p /run/presenced && chown presenced:presenced /run/presenced
COPY --from=build /src/target/release/presenced /usr/local/bin/presenced
COPY packaging/presenced.toml /etc/presenced/presenced.toml
USER presenced
WORKDIR /var/lib/presenced
# The embedded default: accounts and rosters in an SQLite file of the image's volume,
# liveness in process. -e DATABASE_URL=postgres://... (and REDIS_URL for a cluster)
# replaces it.
ENV DATABASE_URL=sqlite:///var/lib/presenced/presenced.db
VOLUME /var/lib/presenced
# c2s STARTTLS, c2s direct TLS, s2s, HTTPS/WebSocket. The admin listener (5281) stays
# on the container's loopback unless the configuration binds it elsewhere.
EXPOSE 5222 5223 5269 5443
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/presenced", "--config", "/etc/presenced/presenced.toml"]
CMD ["serve"]
