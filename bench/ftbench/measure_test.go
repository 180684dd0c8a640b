package main

import (
	"math"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/agentconfig"
)

// detection_median must be the median of the crashes' latencies: for an even count (the default --crashes
// 20, or 6 in bench/results/detect-100ms-400ms.json) the mean of the middle two, not the upper one.
func TestDetectionMedianOfEvenSample(t *testing.T) {
	// bench/results/detect-100ms-400ms.json's six latencies: reported 684.32, their median is 666.56.
	lat := []float64{623.678975, 637.034509, 648.799047, 684.320442, 684.515462, 705.279453}
	for _, m := range detectionMetrics(lat) {
		if m.Name == "detection_median" && math.Abs(m.Value-666.5597445) > 1e-6 {
			t.Errorf("detection_median %.4f, want 666.5597 (the median of %v)", m.Value, lat)
		}
	}
}

// The ping-pong's p50 is the median of its round trips: with half of them 2 ms and half 4 ms, 3 ms.
func TestLMParseP50OfEvenSample(t *testing.T) {
	lines := make([]string, lmRounds)
	for i := range lines {
		lines[i] = "2000000"
		if i%2 == 1 {
			lines[i] = "4000000"
		}
	}
	r, err := lmParse([]byte(strings.Join(lines, "\n") + "\n"))
	if err != nil {
		t.Fatal(err)
	}
	if r.P50MS != 3 {
		t.Errorf("p50 %v ms, want 3 (the median of %d round trips, half 2 ms and half 4 ms)", r.P50MS, lmRounds)
	}
}

// c_snapshots_taken, c_snapshot_size_mean and c_snapshot_frozen_median are computed from the manifests the
// agents still list after the run, which they prune to checkpoint.keep per job (default 3): the compare's
// agents must keep every snapshot a run takes (its start snapshot, one per interval of about CkptEvery
// iterations, and the ones new connections ask for), or those figures cover only the last three.
func TestCompareAgentsKeepEverySnapshot(t *testing.T) {
	for name, sz := range compareSizes {
		keep := cmpAgents("", sz).Keep
		if keep == 0 {
			keep = agentconfig.Defaults().Checkpoint.Keep
		}
		// At least: the start snapshot, one per interval over a run as long as a's, and a connection's.
		if want := 1 + (sz.Iters+sz.CkptEvery-1)/sz.CkptEvery + 1; keep < want {
			t.Errorf("%s: the agents keep %d snapshots per job; a c run takes at least %d, so c_snapshots_taken reports %d per rank at most",
				name, keep, want, keep)
		}
	}
}

// The compression ratio on the wire is the snapshot bytes that went to the compressor over the bytes on
// the wire; the blocks a diff's protector copied from its base never did. One whole send that compresses
// 2.5 times and two diffs whose literal blocks compress 2.5 times: 2.5, not 300 MB / 44 MB = 6.8.
func TestShipCompressionRatio(t *testing.T) {
	results := []agent.SnapshotResult{
		{ShipBytes: 100e6, ShipWire: 40e6},
		{ShipBytes: 100e6, ShipCopied: 95e6, ShipWire: 2e6},
		{ShipBytes: 100e6, ShipCopied: 95e6, ShipWire: 2e6},
	}
	if got := shipCompressionRatio(results); math.Abs(got-2.5) > 1e-9 {
		t.Errorf("compression ratio %.3f, want 2.5", got)
	}
}
