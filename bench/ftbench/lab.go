package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	"github.com/ftkit/ftkit/lab"
)

// benchLab measures how long the lab takes to build and remove, which every end-to-end test and the demo pay.
func benchLab(ctx context.Context, log *slog.Logger) ([]Metric, any, error) {
	const runs = 3
	sizes := []int{4, 8, 16}
	var metrics []Metric
	for _, hosts := range sizes {
		var up, down time.Duration
		for r := 0; r < runs; r++ {
			start := time.Now()
			l, err := lab.Up(ctx, lab.Config{ID: "fbench", Nodes: hosts - 1, Spares: 1,
				Subnet: netip.MustParsePrefix("10.249.0.0/24")}, lab.Options{Logger: log})
			if err != nil {
				return nil, nil, fmt.Errorf("lab up with %d hosts: %w", hosts, err)
			}
			up += time.Since(start)
			start = time.Now()
			if err := l.Down(context.WithoutCancel(ctx)); err != nil {
				return nil, nil, fmt.Errorf("lab down: %w", err)
			}
			down += time.Since(start)
		}
		metrics = append(metrics,
			Metric{Name: fmt.Sprintf("up_%d_hosts", hosts), Value: up.Seconds() / runs * 1000, Unit: "ms"},
			Metric{Name: fmt.Sprintf("down_%d_hosts", hosts), Value: down.Seconds() / runs * 1000, Unit: "ms"})
	}
	return metrics, map[string]any{"runs_per_size": runs, "hosts": sizes}, nil
}
