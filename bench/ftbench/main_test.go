package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// Every name and flag is checked before any benchmark runs: `ftbench netlog --help` once ran the netlog
// benchmark for minutes and then failed on "--help" as a benchmark name.
func TestSelectBenchmarks(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		want    []string
		wantErr string // substring; "help" for flag.ErrHelp
	}{
		{args: nil, want: []string{"compare", "coordinated", "detect", "lab", "large-messages", "lazy-restore", "migrate", "mpi-crash", "netlog",
			"node-recovery", "receive-order", "recovery", "restored-throughput", "snapshot"}},
		{args: []string{"netlog"}, want: []string{"netlog"}},
		{args: []string{"detect", "--crashes", "3", "migrate", "--sizes", "100", "netlog"}, want: []string{"detect", "migrate", "netlog"}},
		{args: []string{"netlog", "--help"}, wantErr: "help"},
		{args: []string{"detect", "-h"}, wantErr: "help"},
		{args: []string{"netlog", "bogus"}, wantErr: `no benchmark "bogus"`},
		{args: []string{"bogus", "netlog"}, wantErr: `no benchmark "bogus"`},
		{args: []string{"netlog", "--sizes", "100"}, wantErr: "flag provided but not defined: -sizes"},
		{args: []string{"snapshot", "detect", "--crashes", "x"}, wantErr: `invalid value "x" for flag -crashes`},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			all, flagSets := benchmarks()
			for _, fs := range flagSets {
				fs.SetOutput(io.Discard)
			}
			got, err := selectBenchmarks(tc.args, all, flagSets)
			switch {
			case tc.wantErr == "help":
				if !errors.Is(err, flag.ErrHelp) {
					t.Fatalf("got %v, %v; want flag.ErrHelp", got, err)
				}
			case tc.wantErr != "":
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %v, %v; want an error saying %q", got, err, tc.wantErr)
				}
			case err != nil || !slices.Equal(got, tc.want):
				t.Fatalf("got %v, %v; want %v", got, err, tc.want)
			}
		})
	}
	d := &detectBench{}
	all, flagSets := benchmarks()
	flagSets["detect"] = d.flags()
	if _, err := selectBenchmarks([]string{"detect", "--crashes", "3"}, all, flagSets); err != nil || d.crashes != 3 {
		t.Fatalf("detect --crashes 3: crashes %d, err %v", d.crashes, err)
	}
}

// A reader of ftbench's output that goes away (`ftbench ... | head`) stops the benchmark through its context,
// so that its lab is removed: ftbench once died of SIGPIPE and left the lab behind. The test runs itself as
// ftbench would, writing to a pipe whose reader is gone.
func TestStopContextOnBrokenPipe(t *testing.T) {
	if os.Getenv("FTBENCH_TEST_BROKEN_PIPE") != "" {
		ctx, stop := stopContext()
		defer stop()
		for ctx.Err() == nil {
			fmt.Println("a benchmark's line")
		}
		fmt.Fprintln(os.Stderr, "stopped by", context.Cause(ctx))
		os.Exit(0)
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	r.Close() // nobody reads: the first write gets EPIPE, and SIGPIPE
	cmd := exec.Command(os.Args[0], "-test.run=^TestStopContextOnBrokenPipe$")
	cmd.Env = append(os.Environ(), "FTBENCH_TEST_BROKEN_PIPE=1")
	var stderr strings.Builder
	cmd.Stdout, cmd.Stderr = w, &stderr
	err = cmd.Run()
	w.Close()
	if err != nil || !strings.Contains(stderr.String(), "stopped by") {
		t.Fatalf("ftbench writing to a closed pipe: %v (%s), want its context canceled and a clean exit", err, stderr.String())
	}
	if !strings.Contains(stderr.String(), "broken pipe") {
		t.Errorf("stopped by %q, want the broken pipe's signal", stderr.String())
	}
}

// TestGapStats reads the agents' "heartbeat gap" lines as agent/cluster.go writes them.
func TestGapStats(t *testing.T) {
	log := `time=2026-12-01T15:08:45.192Z level=INFO msg="heartbeat gap" node=node1 member=node4 arrived_after=187ms sent_after=176ms missing=0 late="on the sender (its beat was sent late)"
time=2026-12-01T15:08:45.193Z level=INFO msg="snapshot taken" node=node2 arrived_after=900ms
time=2026-12-01T15:08:45.197Z level=INFO msg="heartbeat gap" node=node4 member=node3 arrived_after=1.25s sent_after=85ms missing=0 late="on the way here (network, this host's kernel or agent)"
`
	var g gapStats
	g.add(log)
	if want := (gapStats{Count: 2, OnSender: 1, Longest: 1250}); g != want {
		t.Errorf("gapStats %+v, want %+v", g, want)
	}
}

// The soak's copies of the agents' logs are written by ftbench, as root, into a directory of their own:
// under fixed names in the shared /tmp (ftbench-detect-soak-HOST.log) a user's link planted there ahead of
// the soak had root write the logs through it, over whatever file it named.
func TestKeepSoakLogsFollowsNoPlantedLink(t *testing.T) {
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	victim := filepath.Join(t.TempDir(), "victim")
	if err := os.WriteFile(victim, []byte("precious\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, host := range []string{"node1", "node2"} {
		if err := os.Symlink(victim, filepath.Join(tmp, "ftbench-detect-soak-"+host+".log")); err != nil {
			t.Fatal(err)
		}
	}
	kept, err := keepSoakLogs(map[string][]byte{"node1": []byte("node1's log\n"), "node2": []byte("node2's log\n")})
	if err != nil {
		t.Fatalf("keepSoakLogs: %v", err)
	}
	if b, _ := os.ReadFile(victim); string(b) != "precious\n" {
		t.Errorf("the file a planted link named now holds %q", b)
	}
	for _, host := range []string{"node1", "node2"} {
		if b, err := os.ReadFile(kept[host]); err != nil || string(b) != host+"'s log\n" {
			t.Errorf("%s's copy %s: %q, %v", host, kept[host], b, err)
		}
		if fi, err := os.Lstat(kept[host]); err != nil || !fi.Mode().IsRegular() {
			t.Errorf("%s's copy %s is not a regular file of its own: %v", host, kept[host], err)
		}
	}
}
