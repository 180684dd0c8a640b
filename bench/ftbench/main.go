// Command ftbench runs ftkit's benchmarks on this machine and writes one JSON file per benchmark to
// bench/results/, plus a short table on stdout. Performance claims in docs/design.md (and the README's
// summary of them) come from these files: ratios measured within one run, never timed assertions in tests.
//
//	ftbench [--out DIR] [NAME [FLAG...]...]     (default: every benchmark)
//
// A benchmark name may be followed by its own flags (ftbench detect --crashes 5 --soak 10m).
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"sort"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/internal/version"
)

// Metric is one measured number.
type Metric struct {
	Name  string  `json:"name"`
	Value float64 `json:"value"`
	Unit  string  `json:"unit"`
}

// Result is what one benchmark writes to bench/results/NAME.json.
type Result struct {
	Name     string       `json:"name"`
	Started  time.Time    `json:"started"`
	Seconds  float64      `json:"seconds"`
	Machine  version.Info `json:"machine"`
	CPUs     int          `json:"cpus"`
	Metrics  []Metric     `json:"metrics"`
	Settings any          `json:"settings,omitempty"`
}

type benchmark func(ctx context.Context, log *slog.Logger) (metrics []Metric, settings any, err error)

// benchmarks are the benchmarks by name, and the flags of those that take any.
func benchmarks() (map[string]benchmark, map[string]*flag.FlagSet) {
	d, m := &detectBench{}, &migrateBench{}
	return map[string]benchmark{
		"compare":             benchCompare,
		"coordinated":         benchCoordinated,
		"detect":              d.run,
		"lab":                 benchLab,
		"lazy-restore":        benchLazyRestore,
		"migrate":             m.run,
		"netlog":              benchNetlog,
		"node-recovery":       benchNodeRecovery,
		"receive-order":       benchReceiveOrder,
		"recovery":            benchRecovery,
		"restored-throughput": benchRestored,
		"snapshot":            benchSnapshot,
	}, map[string]*flag.FlagSet{"detect": d.flags(), "migrate": m.flags()}
}

func main() {
	out := flag.String("out", "bench/results", "directory for the JSON results")
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	all, flagSets := benchmarks()
	var names []string
	for args := flag.Args(); len(args) > 0; {
		names, args = append(names, args[0]), args[1:]
		if fs, ok := flagSets[names[len(names)-1]]; ok {
			if err := fs.Parse(args); err != nil {
				os.Exit(cli.ExitUsage)
			}
			args = fs.Args()
		}
	}
	if len(names) == 0 {
		for n := range all {
			names = append(names, n)
		}
		sort.Strings(names)
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, "ftbench:", err)
		os.Exit(1)
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "benchmark\tmetric\tvalue\tunit\t")
	failed := false
	for _, name := range names {
		b, ok := all[name]
		if !ok {
			fmt.Fprintf(os.Stderr, "ftbench: no benchmark %q\n", name)
			os.Exit(cli.ExitUsage)
		}
		start := time.Now()
		log.Info("benchmark", "name", name)
		metrics, settings, err := b(ctx, log)
		if err != nil {
			log.Error("benchmark failed", "name", name, "err", err)
			failed = true
			continue
		}
		res := Result{Name: name, Started: start.UTC(), Seconds: time.Since(start).Seconds(), Machine: version.Collect(""),
			CPUs: runtime.NumCPU(), Metrics: metrics, Settings: settings}
		if err := writeJSON(filepath.Join(*out, name+".json"), res); err != nil {
			log.Error("write result", "name", name, "err", err)
			failed = true
		}
		for _, m := range metrics {
			fmt.Fprintf(tw, "%s\t%s\t%.4g\t%s\t\n", name, m.Name, m.Value, m.Unit)
		}
	}
	tw.Flush()
	if failed {
		os.Exit(cli.ExitFailure)
	}
}

func writeJSON(path string, v any) error {
	var b bytes.Buffer
	if err := cli.PrintJSON(&b, v); err != nil {
		return err
	}
	return atomicfile.WriteFile(path, b.Bytes(), 0o644)
}
