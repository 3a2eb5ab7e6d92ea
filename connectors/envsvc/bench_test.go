package envsvc

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/trajflow/trajflow/operators/rollout"
	"github.com/trajflow/trajflow/schemas"
)

// episodeActions is the length of the benchmarks' episodes: every worker
// runs kv episodes of this many lookups (then terminates and allocates the
// next), so the numbers include allocation and termination.
const episodeActions = 8

// BenchmarkSteps: actions/s and p50/p99 latency of one action in process
// and through the service (HTTP on 127.0.0.1, Badger on disk with and
// without fsync before every acknowledgement, or in memory), with 1 and 8
// concurrent episodes.
//
//	go test -run '^$' -bench BenchmarkSteps -benchtime 3s ./connectors/envsvc/
func BenchmarkSteps(b *testing.B) {
	for _, par := range []int{1, 8} {
		b.Run(name("in-process", par), func(b *testing.B) { benchSteps(b, par, nil) })
		for _, mode := range []string{"memory", "sync=off", "sync=on"} {
			b.Run(name("service/"+mode, par), func(b *testing.B) {
				cfg := Config{Registries: registries(b)}
				switch mode {
				case "sync=off":
					cfg.Store = openStore(b, b.TempDir(), false)
				case "sync=on":
					cfg.Store = openStore(b, b.TempDir(), true)
				}
				svc := startService(b, cfg)
				c := newClient(b, []string{svc.url}, Options{})
				benchSteps(b, par, c)
				if cfg.Store != nil {
					b.Cleanup(func() { cfg.Store.Close() })
				}
			})
		}
	}
}

func name(s string, par int) string {
	if par == 1 {
		return s + "/episodes=1"
	}
	return s + "/episodes=8"
}

// benchSteps runs b.N lookups spread over par workers against env (nil:
// the in-process registry) and reports actions/s and step latencies.
func benchSteps(b *testing.B, par int, env rollout.Environment) {
	ctx := context.Background()
	reg := family(registries(b), rollout.FamilyKV)
	if env == nil {
		env = reg
	}
	tasks := reg.Train()
	var mu sync.Mutex
	var lat []time.Duration
	var wg sync.WaitGroup
	errs := make(chan error, par)
	b.ResetTimer()
	start := time.Now()
	for w := 0; w < par; w++ {
		n := b.N / par
		if w < b.N%par {
			n++
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			mine := make([]time.Duration, 0, n)
			var ep rollout.Episode
			var turn int32
			for i, k := 0, 0; i < n; i++ {
				if ep == nil {
					task := tasks[(w*7919+k)%len(tasks)]
					a := rollout.Attempts("bench", task, int64(k), 1, 1, 0, "c")[0]
					a.AttemptID = schemas.AttemptID("bench", task.ID, a.GroupID, int32(w), int32(k))
					var err error
					if ep, _, err = env.Reset(ctx, a); err != nil {
						errs <- err
						return
					}
					k++
					turn = 0
				}
				t0 := time.Now()
				_, err := ep.Step(ctx, turn, rollout.EnvAction{IDs: []int32{rollout.TokCall, rollout.TokKey0 + int32(i%4), rollout.TokEnd}})
				mine = append(mine, time.Since(t0))
				if err != nil {
					errs <- err
					return
				}
				turn++
				if turn == episodeActions || i == n-1 {
					if _, err := ep.Close(ctx, rollout.ReasonMaxTurns); err != nil {
						errs <- err
						return
					}
					ep = nil
				}
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	el := time.Since(start)
	b.StopTimer()
	select {
	case err := <-errs:
		b.Fatal(err)
	default:
	}
	slices.Sort(lat)
	pct := func(p float64) float64 {
		if len(lat) == 0 {
			return 0
		}
		return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))].Nanoseconds()) / 1e3
	}
	b.ReportMetric(float64(b.N)/el.Seconds(), "actions/s")
	b.ReportMetric(pct(0.50), "p50-µs")
	b.ReportMetric(pct(0.99), "p99-µs")
}
