package main

import (
	"strings"
	"testing"
)

func TestLMParse(t *testing.T) {
	lines := make([]string, lmRounds)
	for i := range lines {
		lines[i] = "2000000" // 2 ms
	}
	lines[7], lines[100] = "350000000", "150000000" // two stalls: 350 ms, 150 ms
	lines[8] = "99000000"                           // under the stall threshold
	r, err := lmParse([]byte(strings.Join(lines, "\n") + "\n"))
	if err != nil {
		t.Fatal(err)
	}
	if r.Stalls != 2 || r.MaxMS != 350 || r.P50MS != 2 {
		t.Errorf("got stalls %d, max %v ms, p50 %v ms; want 2, 350, 2", r.Stalls, r.MaxMS, r.P50MS)
	}
	wantMean := (2*float64(lmRounds-3) + 350 + 150 + 99) / lmRounds
	if d := r.MeanMS - wantMean; d > 1e-9 || d < -1e-9 {
		t.Errorf("mean %v ms, want %v", r.MeanMS, wantMean)
	}

	for _, bad := range []string{"", "1 2 3", strings.Repeat("x\n", lmRounds), strings.Repeat("-5\n", lmRounds)} {
		if _, err := lmParse([]byte(bad)); err == nil {
			t.Errorf("lmParse(%.20q) accepted it", bad)
		}
	}
}
