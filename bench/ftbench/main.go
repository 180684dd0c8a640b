// Command ftbench runs ftkit's benchmarks on this machine and writes one JSON file per benchmark to
// bench/results/, plus a short table on stdout. Performance claims in docs/design.md (and the README's
// summary of them) come from these files: ratios measured within one run, never timed assertions in tests.
//
//	ftbench [--out DIR] [NAME [FLAG...]...]     (default: every benchmark)
//
// A benchmark name may be followed by its own flags (ftbench detect --crashes 5 --soak 10m; NAME --help
// lists them). Every name and flag is checked before the first benchmark runs.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
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

// benchmarks are the benchmarks by name, and the flags of each (empty for most).
func benchmarks() (map[string]benchmark, map[string]*flag.FlagSet) {
	d, m := &detectBench{}, &migrateBench{}
	all := map[string]benchmark{
		"compare":             benchCompare,
		"coordinated":         benchCoordinated,
		"detect":              d.run,
		"lab":                 benchLab,
		"large-messages":      benchLargeMessages,
		"lazy-restore":        benchLazyRestore,
		"migrate":             m.run,
		"netlog":              benchNetlog,
		"mpi-crash":           benchMPICrash,
		"node-recovery":       benchNodeRecovery,
		"receive-order":       benchReceiveOrder,
		"recovery":            benchRecovery,
		"restored-throughput": benchRestored,
		"snapshot":            benchSnapshot,
	}
	flagSets := map[string]*flag.FlagSet{"detect": d.flags(), "migrate": m.flags()}
	for name := range all {
		if flagSets[name] == nil {
			fs := flag.NewFlagSet(name, flag.ContinueOnError)
			fs.Usage = func() { fmt.Fprintf(fs.Output(), "ftbench %s takes no flags\n", name) }
			flagSets[name] = fs
		}
	}
	return all, flagSets
}

// selectBenchmarks reads the benchmark names of args, each followed by its own flags, and returns them
// in order; none means every benchmark. It checks every name and flag before any benchmark runs: one
// that takes minutes and sets up a lab must not run only for the command to fail on a typo after it.
func selectBenchmarks(args []string, all map[string]benchmark, flagSets map[string]*flag.FlagSet) ([]string, error) {
	var names []string
	for len(args) > 0 {
		name := args[0]
		if _, ok := all[name]; !ok {
			return nil, fmt.Errorf("no benchmark %q (there are: %s)", name, strings.Join(slices.Sorted(maps.Keys(all)), ", "))
		}
		fs := flagSets[name]
		if err := fs.Parse(args[1:]); err != nil {
			return nil, flagError{err} // the flag set printed it, with its usage
		}
		names, args = append(names, name), fs.Args()
	}
	if len(names) == 0 {
		names = slices.Sorted(maps.Keys(all))
	}
	return names, nil
}

// flagError is a benchmark's flag that did not parse, already reported by its flag set.
type flagError struct{ error }

func (e flagError) Unwrap() error { return e.error }

func main() {
	out := flag.String("out", "bench/results", "directory for the JSON results")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: ftbench [--out DIR] [NAME [FLAG...]...]  (default: every benchmark; NAME --help lists its flags)\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	ctx, stop := stopContext()
	defer stop()

	all, flagSets := benchmarks()
	names, err := selectBenchmarks(flag.Args(), all, flagSets)
	switch {
	case errors.Is(err, flag.ErrHelp):
		return
	case errors.As(err, new(flagError)):
		os.Exit(cli.ExitUsage)
	case err != nil:
		fmt.Fprintln(os.Stderr, "ftbench:", err)
		os.Exit(cli.ExitUsage)
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, "ftbench:", err)
		os.Exit(1)
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "benchmark\tmetric\tvalue\tunit\t")
	failed := false
	for _, name := range names {
		b := all[name]
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

// stopContext is canceled by every signal that would otherwise kill ftbench without its cleanup, which
// removes the benchmark's lab (namespaces, cgroups, agents): SIGINT and SIGTERM, SIGHUP (the terminal went
// away) and SIGPIPE (`ftbench ... | head` once left a lab behind when head exited; notified, a write to the
// closed pipe fails instead, and the benchmark stops as if interrupted).
func stopContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGPIPE)
}

func writeJSON(path string, v any) error {
	var b bytes.Buffer
	if err := cli.PrintJSON(&b, v); err != nil {
		return err
	}
	return atomicfile.WriteFile(path, b.Bytes(), 0o644)
}
