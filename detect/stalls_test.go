package detect

import "testing"

// TestStalls: a tick later than period+limit is a stall; Since sees stalls that ended after t and a
// stall still going on at now, and nothing before the first tick.
func TestStalls(t *testing.T) {
	for _, tc := range []struct {
		name   string
		ticks  []int // ms
		since  int
		now    int
		want   bool
		stalls uint64
	}{
		{"no ticks yet", nil, 0, 1000, false, 0},
		{"on time", []int{0, 10, 20, 30, 40}, 0, 45, false, 0},
		{"late but within the limit", []int{0, 10, 20, 79, 90}, 0, 95, false, 0},
		{"a stall after t", []int{0, 10, 20, 100, 110}, 15, 115, true, 1},
		{"a stall before t", []int{0, 10, 20, 100, 110}, 100, 115, false, 1},
		{"a stall going on", []int{0, 10, 20}, 0, 200, true, 0},
		{"ended just at t is not after t", []int{0, 100}, 100, 105, false, 1},
		{"several stalls", []int{0, 100, 200, 210}, 0, 215, true, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewStalls(10e6, 50e6) // 10 ms period, 50 ms limit
			for _, ms := range tc.ticks {
				s.Tick(at(ms))
			}
			if got := s.Since(at(tc.since), at(tc.now)); got != tc.want {
				t.Errorf("Since(%d, %d) = %v, want %v", tc.since, tc.now, got, tc.want)
			}
			if s.Count() != tc.stalls {
				t.Errorf("Count %d, want %d", s.Count(), tc.stalls)
			}
		})
	}
}
