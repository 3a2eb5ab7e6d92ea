package policy

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/trajflow/trajflow/gpu/model"
)

// Each runs one(ctx, i) for i in [0, n), at most limit at a time (limit <=
// 0: all at once), and returns the samples and, when any failed, the error
// of each request (nil for those that succeeded). When failFast is set the
// first failure cancels the requests still running or waiting; those then
// carry the cancellation as their error. Each returns when every call has
// returned.
func Each(ctx context.Context, n, limit int, failFast bool, one func(ctx context.Context, i int) (model.Sample, error)) ([]model.Sample, []error) {
	out := make([]model.Sample, n)
	errs := make([]error, n)
	if n == 0 {
		return out, nil
	}
	if limit <= 0 || limit > n {
		limit = n
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		failed bool
	)
	next := make(chan int)
	for w := 0; w < limit; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := ctx.Err(); err != nil {
					errs[i] = err
					continue
				}
				s, err := one(ctx, i)
				out[i], errs[i] = s, err
				if err != nil {
					mu.Lock()
					failed = true
					mu.Unlock()
					if failFast {
						cancel()
					}
				}
			}
		}()
	}
	for i := 0; i < n; i++ {
		next <- i
	}
	close(next)
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if !failed {
		return out, nil
	}
	return out, errs
}

// FirstError is the error to report for a batch: the first failure in
// batch order that is not a consequence of the batch being cancelled after
// it (when failFast stopped the rest), else the first one.
func FirstError(parent context.Context, errs []error) error {
	var first error
	for i, err := range errs {
		if err == nil {
			continue
		}
		err = fmt.Errorf("request %d: %w", i, err)
		if first == nil {
			first = err
		}
		if parent.Err() != nil || !isCancel(errs[i]) {
			return err
		}
	}
	return first
}

func isCancel(err error) bool {
	return errors.Is(err, context.Canceled) && !IsInfra(err)
}

// One generates one request for a client.
type One func(ctx context.Context, req model.Request, want Want) (model.Sample, error)

// Generate is rollout.Policy's Generate over one-request calls: all
// requests concurrently (at most limit at a time), the first failure
// cancelling the rest and failing the call.
func Generate(ctx context.Context, reqs []model.Request, limit int, want Want, one One) ([]model.Sample, error) {
	out, errs := Each(ctx, len(reqs), limit, true, func(ctx context.Context, i int) (model.Sample, error) {
		return one(ctx, reqs[i], want)
	})
	if errs != nil {
		return nil, FirstError(ctx, errs)
	}
	return out, nil
}

// GenerateEach is Client.GenerateEach over one-request calls.
func GenerateEach(ctx context.Context, reqs []model.Request, limit int, want Want, one One) ([]model.Sample, []error) {
	return Each(ctx, len(reqs), limit, false, func(ctx context.Context, i int) (model.Sample, error) {
		return one(ctx, reqs[i], want)
	})
}
