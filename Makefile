# trajflow — see README.md.
GO      ?= go
BIN     ?= bin/trajflow
PKGS    ?= ./...

.PHONY: build test test-short lint bench fuzz demo clean tidy-check kafka-up kafka-down test-integration

build:
	$(GO) build -o $(BIN) ./cmd/trajflow

# The full test suite (what CI runs). Tests start their own embedded
# brokers and child processes on 127.0.0.1.
test: build
	$(GO) test -count=1 -timeout 20m $(PKGS)

test-short:
	$(GO) test -short -count=1 $(PKGS)

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt: $$out"; exit 1; fi
	$(GO) vet $(PKGS)
	@cp go.mod /tmp/trajflow.go.mod.bak && cp go.sum /tmp/trajflow.go.sum.bak && $(GO) mod tidy && \
	  if ! git diff --quiet -- go.mod go.sum; then echo "go mod tidy changes go.mod/go.sum"; git diff -- go.mod go.sum; exit 1; fi

bench:
	$(GO) test -run '^$$' -bench . -benchmem $(PKGS)

# Bounded fuzzing of every decoder and the contract parser.
FUZZTIME ?= 10s
fuzz:
	@for spec in $$(grep -rl --include='*_test.go' '^func Fuzz' . | xargs -n1 dirname | sort -u); do \
	  for f in $$(grep -h '^func Fuzz' $$spec/*_test.go | sed 's/func \(Fuzz[A-Za-z0-9_]*\).*/\1/'); do \
	    echo "fuzz $$spec $$f"; $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) $$spec || exit 1; \
	  done; \
	done

# Real Apache Kafka (KRaft, single node, 127.0.0.1:19092; SASL_SSL on 19093)
# fetched from Maven Central into build/kafka; see deploy/local/kafka.sh.
KAFKA_SH ?= deploy/local/kafka.sh
kafka-up:
	$(KAFKA_SH) up

kafka-down:
	$(KAFKA_SH) down

# The integration suite against the broker started by `make kafka-up`:
# fault injection (kills, broker restart, rebalance), bad input, TLS/SASL.
test-integration: build
	eval "$$($(KAFKA_SH) env)" && export TRAJFLOW_KAFKA TRAJFLOW_KAFKA_SASL TRAJFLOW_KAFKA_HOME && \
	  $(GO) test -count=1 -timeout 15m -tags integration -v ./integration/

demo: build
	./$(BIN) demo --out out/demo

clean:
	rm -rf bin out
