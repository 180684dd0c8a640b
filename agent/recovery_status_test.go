package agent

import "testing"

func TestRunningSummary(t *testing.T) {
	tests := []struct {
		jobs, running []string
		want          string
	}{
		{[]string{"a", "b"}, []string{"a", "b"}, "job(s) a, b run there"},
		{[]string{"a", "b"}, []string{"b"}, "job(s) b run there; job(s) a do NOT run there"},
		{[]string{"a"}, nil, "job(s) a do NOT run there"},
	}
	for _, tt := range tests {
		if got := runningSummary(tt.jobs, tt.running); got != tt.want {
			t.Errorf("runningSummary(%v, %v) = %q, want %q", tt.jobs, tt.running, got, tt.want)
		}
	}
}
