# syntax=docker/dockerfile:1
#
# One image for every Capstan role: the container command picks the binary.
#   /usr/local/bin/gateway     gRPC API (:7233) + admin (:7234)
#   /usr/local/bin/dispatcher  outbox -> Kafka (:7235 nudges) + admin (:7236)
#   /usr/local/bin/consumer    attempt loop, admin (:7237)
#   /usr/local/bin/router      completion-event webhooks, admin (:7238)
#   /usr/local/bin/capstanctl  operator CLI (`capstanctl migrate` for the migration Job)
#
# Build: docker build -t capstan:dev .
# The daemons take --config <yaml> (or $CAPSTAN_CONFIG) and CAPSTAN_* variables;
# see internal/config and docs/operations.md.

ARG GO_VERSION=1.26

FROM golang:${GO_VERSION} AS build
WORKDIR /src
ENV CGO_ENABLED=0 GOFLAGS=-buildvcs=false
# Module downloads first, so source edits reuse the cached layer.
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod \
    go mod download
COPY . .
ARG TARGETOS
ARG TARGETARCH
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    mkdir -p /out && \
    GOOS=${TARGETOS:-linux} GOARCH=${TARGETARCH} \
    CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /out/ \
        ./cmd/gateway ./cmd/dispatcher ./cmd/consumer ./cmd/router ./cmd/capstanctl

# distroless static, :nonroot runs as uid/gid 65532 with no shell and no package manager.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/ /usr/local/bin/
USER 65532:65532
# gateway gRPC, gateway admin, dispatcher gRPC, dispatcher admin, consumer admin, router admin
EXPOSE 7233 7234 7235 7236 7237 7238
# No default role: Kubernetes sets the command (see deploy/k8s). Running the image bare prints
# capstanctl's usage.
ENTRYPOINT ["/usr/local/bin/capstanctl"]
