// Package deploytest runs trajflow fleets the way a deployment runs them:
// every operator its own `trajflow run` process, or its own container of the
// image (deploy/image, build tag "container"), with a fixed health address
// probed the way Kubernetes probes it (/readyz, /healthz), restarted one by
// one as a rolling update restarts them (the strategy of each stage read
// from the manifests in deploy/k8s), and accounted for with internal/audit.
//
// The tests:
//
//   - TestRollingRestart: the whole loop (dispatch, rollout, validate ×2,
//     reward ×2, advantage, pack, train, snapshot) on `trajflow broker` or,
//     with TRAJFLOW_KAFKA_CLUSTER set, on the replicated cluster of
//     deploy/local/cluster.sh; every operator is restarted once while rounds
//     run. Nothing may be lost or admitted twice, and the batches must be
//     those of the uninterrupted in-process demo of the same seed, bit for bit.
//   - BenchmarkStages: validate, reward, advantage and pack as separate
//     processes fed by the bench's synthetic source; each process's CPU time
//     per message and peak RSS (the resource requests of deploy/k8s).
//   - image_test.go (build tag container, `make test-image`): the image's
//     layers, `trajflow demo` in a container, and the rolling restart with
//     every operator a container on the host network.
package deploytest
