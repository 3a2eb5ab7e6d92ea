//go:build llama

package llamatest

import (
	"context"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// BenchmarkCompletion64 generates 64 tokens per request (ignore_eos, the
// neutral sampler, n_probs 1) on one stream and on two streams at once (the
// server's two slots), and reports generated tokens per second of wall time
// and the server's resident memory.
func BenchmarkCompletion64(b *testing.B) {
	s := Start(b, Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	prompt := chatPrompt(b, ctx, s, "Write a short story about a lighthouse.")
	for _, streams := range []int{1, 2} {
		b.Run("streams="+strconv.Itoa(streams), func(b *testing.B) {
			tokens := 0
			var mu sync.Mutex
			start := time.Now()
			for i := 0; i < b.N; i++ {
				var wg sync.WaitGroup
				for k := 0; k < streams; k++ {
					wg.Add(1)
					go func() {
						defer wg.Done()
						req := Neutral(prompt, 64, uint32(i*streams+k), 1)
						req.IgnoreEOS = true
						r, err := s.Complete(ctx, req)
						if err != nil {
							b.Error(err)
							return
						}
						mu.Lock()
						tokens += len(r.Tokens)
						mu.Unlock()
					}()
				}
				wg.Wait()
			}
			b.ReportMetric(float64(tokens)/time.Since(start).Seconds(), "tokens/s")
			if rss := rssMiB(s.Pid()); rss > 0 {
				b.ReportMetric(rss, "rss-MiB")
			}
		})
	}
}

func rssMiB(pid int) float64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseFloat(f[1], 64)
			return kb / 1024
		}
	}
	return 0
}
