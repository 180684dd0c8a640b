package main

import (
	"errors"
	"flag"
	"io"
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
		{args: nil, want: []string{"compare", "coordinated", "detect", "lab", "lazy-restore", "migrate", "netlog",
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
