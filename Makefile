# ftkit: `make demo` runs the main job, `make test` runs every test. Both do all set-up they need (as root).
SHELL   := /bin/bash
GO      ?= go
PKG     := github.com/ftkit/ftkit
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo devel)
LDFLAGS := -X $(PKG)/internal/version.Version=$(VERSION)
BIN     := bin
CMDS    := ftctl ftagent ftwrap
# The tests' own parallelism: two packages at a time fits the 2-core machines this runs on.
TESTFLAGS ?= -count=1 -p 2 -timeout 45m

# The test programs (go's ./... skips testdata directories, so they are named).
PROGS := $(patsubst %/,./%,$(wildcard testdata/*/))

# Preloaded into MPICH ranks by `ftctl mpirun --impl mpich` (the file says why); ftctl finds it next to itself.
MPICHLIB = $(CC) -shared -fPIC -O2 -Wall -Werror scripts/mpi/ftkit-mpich-finalize.c

.PHONY: all setup build test unit lint generate check-generate demo bench clean package

all: build

setup:
	@scripts/setup.sh

build: setup
	@mkdir -p $(BIN)
	$(GO) build -ldflags '$(LDFLAGS)' -o $(BIN)/ ./cmd/... $(PROGS) ./bench/ftbench
	$(MPICHLIB) -o $(BIN)/libftkit-mpich.so

lint: setup
	@$(GO) mod tidy -diff || { echo "go.mod/go.sum are not tidy (diff above): run 'go mod tidy' and commit"; exit 1; }
	@unformatted=$$(git ls-files '*.go' | xargs "$$($(GO) env GOROOT)/bin/gofmt" -l); [ -z "$$unformatted" ] || { echo "not gofmt'ed (run gofmt -w): $$unformatted"; exit 1; }
	$(GO) vet ./... $(PROGS)
	$(GO) tool staticcheck ./... $(PROGS)

# Regenerate the bpf2go output; `check-generate` fails if the committed files differ from a fresh run.
generate: setup
	$(GO) generate ./...

check-generate: generate
	@git diff --exit-code -- ebpfprobes ackclamp bpf || { echo "generated eBPF files are stale: run 'make generate' and commit"; exit 1; }

# go test's own output (gotestsum's standard-quiet), then every test that took 30 s or more: the suite's
# budget is spent in agent/e2e, and a CI log should say where. build/test.json keeps every test's events.
test: build lint check-generate
	@mkdir -p build
	$(GO) tool gotestsum --format standard-quiet --jsonfile build/test.json -- $(TESTFLAGS) ./... $(PROGS); \
	rc=$$?; echo "tests that took 30 s or more:"; $(GO) tool gotestsum tool slowest --jsonfile build/test.json --threshold 30s; exit $$rc

# Pure unit tests only, even as root: quick feedback while editing. In -short mode every test that needs
# the kernel (labs, CRIU, eBPF, cgroups) or a browser skips itself (internal/testenv.RequireKernel).
unit:
	$(GO) test -count=1 -short ./... $(PROGS)

demo: build
	@scripts/demo.sh

bench: build
	$(BIN)/ftbench --out bench/results

# The .deb (deploy/nfpm.yaml): the three binaries, the systemd unit, the example config, ftctl's shell
# completion and the docs, written to $(PKGOUT). Debian versions start with a digit: a tag v1.2.3 gives
# 1.2.3 (1.2.3+4+gabc after it), an untagged commit 0.0~git<commit count>.<describe>: the count makes a later
# build the newer package (dpkg compares hashes as text, so half of them would be downgrades).
PKGOUT ?= $(BIN)
DEB_VERSION := $(shell echo '$(VERSION)' | sed -E 's/^v([0-9])/\1/; t; s/^/0.0~git$(shell git rev-list --count HEAD 2>/dev/null || echo 0)./' | tr - '+')

# Built into its own staging directory, never into bin/: `make test` runs the package test while other
# tests execute the binaries in bin/.
PKGSTAGE := build/package

package:
	@mkdir -p $(PKGSTAGE)/completion $(PKGOUT)
	$(GO) build -ldflags '$(LDFLAGS)' -o $(PKGSTAGE)/ ./cmd/...
	$(MPICHLIB) -o $(PKGSTAGE)/libftkit-mpich.so
	$(PKGSTAGE)/ftctl completion bash > $(PKGSTAGE)/completion/ftctl.bash
	$(PKGSTAGE)/ftctl completion zsh > $(PKGSTAGE)/completion/ftctl.zsh
	FTKIT_DEB_VERSION='$(DEB_VERSION)' $(GO) tool nfpm package --config deploy/nfpm.yaml --packager deb --target $(PKGOUT)/

clean:
	rm -rf $(BIN) build
