# Capstan Makefile. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

BIN        := $(CURDIR)/bin
TOOLS      := $(CURDIR)/.tools
GO         ?= go
INPUT      ?= examples/csv-payments/testdata/payments_1k.csv
MODE       ?= direct
SHAPE      ?= row
GOTEST_FLAGS ?= -race -count=1 -timeout 20m

# Pinned code generators (installed into .tools/ by `make tools`).
BUF_VERSION                := v1.47.2
PROTOC_GEN_GO_VERSION      := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.5.1

DAEMONS := gateway dispatcher consumer router capstanctl
EXAMPLES := csv-payments-provider csv-payments-app

.PHONY: help
help: ## List the targets.
	@grep -hE '^[a-zA-Z_/-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

.PHONY: build
build: ## Build the daemons, capstanctl and the example binaries into bin/.
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/ ./cmd/...
	$(GO) build -o $(BIN)/csv-payments-provider ./examples/csv-payments/provider
	$(GO) build -o $(BIN)/csv-payments-app ./examples/csv-payments/app

.PHONY: demo
demo: build ## Run the csv-payments demo on the embedded stack (INPUT=file.csv, MODE=direct|webhook|kafka|callback, SHAPE=row|file: one execution per row, or the whole file as one over kafka).
	$(BIN)/capstanctl dev --bin-dir $(BIN) --demo-input $(INPUT) --demo-mode $(MODE) --demo-shape $(SHAPE)

.PHONY: test
test: check-generated ## Check generated code, then run every test (unit, PostgreSQL + kfake integration, end to end) with the race detector.
	$(GO) test $(GOTEST_FLAGS) ./...

.PHONY: test/short
test/short: ## Run the fast tests only (no daemons as processes).
	$(GO) test -short -count=1 ./...

.PHONY: bench
bench: ## Run the benchmarks and print their figures.
	$(GO) test -run '^$$' -bench . -benchmem ./...

.PHONY: tools
tools: ## Install the pinned code generators into .tools/.
	@mkdir -p $(TOOLS)
	GOBIN=$(TOOLS) $(GO) install github.com/bufbuild/buf/cmd/buf@$(BUF_VERSION)
	GOBIN=$(TOOLS) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
	GOBIN=$(TOOLS) $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)

.PHONY: generate
generate: ## Regenerate the Go code from proto/ with buf and the pinned local plugins.
	@test -x $(TOOLS)/buf -a -x $(TOOLS)/protoc-gen-go -a -x $(TOOLS)/protoc-gen-go-grpc || $(MAKE) tools
	PATH=$(TOOLS):$$PATH $(TOOLS)/buf lint
	PATH=$(TOOLS):$$PATH $(TOOLS)/buf generate

.PHONY: check-generated
check-generated: generate ## Fail when regenerating pkg/gen from proto/ changes anything.
	@git diff --exit-code --stat -- pkg/gen || { echo "pkg/gen is stale: run make generate and commit"; exit 1; }
	@test -z "$$(git status --porcelain -- pkg/gen)" || { echo "untracked generated files: commit them"; git status --porcelain -- pkg/gen; exit 1; }

.PHONY: verify
verify: check-generated ## Fail when regeneration, gofmt, go vet or `go mod tidy` would change anything.
	$(GO) mod tidy
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { echo "gofmt would change:"; gofmt -l $$(git ls-files '*.go'); exit 1; }
	$(GO) vet ./...
	@git diff --exit-code -- go.mod go.sum || { echo "go.mod is not tidy: run go mod tidy and commit"; exit 1; }

.PHONY: clean
clean: ## Remove build output and demo run folders.
	rm -rf $(BIN) run
