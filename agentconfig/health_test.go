package agentconfig

import (
	"slices"
	"strings"
	"testing"
	"time"
)

func TestHealthConfigValidate(t *testing.T) {
	ok := HealthConfig{Command: []string{"/usr/local/sbin/ftkit-health", "{host}"}, Interval: Duration{30 * time.Second},
		Timeout: Duration{10 * time.Second}, LeadTime: Duration{30 * time.Minute}, Recall: 0.5}
	tests := []struct {
		name   string
		change func(*HealthConfig)
		err    string
	}{
		{"valid", func(*HealthConfig) {}, ""},
		{"no command: off, nothing else checked", func(h *HealthConfig) { *h = HealthConfig{} }, ""},
		{"relative program", func(h *HealthConfig) { h.Command[0] = "ftkit-health" }, "absolute path"},
		{"unknown placeholder", func(h *HealthConfig) { h.Command[1] = "{address}" }, "only placeholder is {host}"},
		{"timeout beyond the interval", func(h *HealthConfig) { h.Timeout.Duration = time.Minute }, "at most the interval"},
		{"no lead time", func(h *HealthConfig) { h.LeadTime.Duration = 0 }, "lead_time"},
		{"recall 1", func(h *HealthConfig) { h.Recall = 1 }, "recall"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := ok
			h.Command = slices.Clone(ok.Command)
			tt.change(&h)
			err := h.validate()
			if tt.err == "" && err != nil || tt.err != "" && (err == nil || !strings.Contains(err.Error(), tt.err)) {
				t.Fatalf("validate = %v, want %q", err, tt.err)
			}
		})
	}
}

// The agent runs the health command, as root, every health.interval (tickgrid), and its timeout is at most
// the interval: a few nanoseconds or microseconds (a typo for "30s" or "500ms") made the agent fork the
// command back to back, each run killed before it could answer, so nothing was ever predicted. Refused.
func TestHealthIntervalNotABusyLoop(t *testing.T) {
	for _, tt := range []struct{ interval, wantErr string }{
		{"30s", ""},
		{"200ms", ""}, // the e2e test's
		{"100ms", ""},
		{"30ms", "health: interval 30ms"},
		{"30us", "health: interval 30µs"},
		{"1ns", "health: interval 1ns"},
	} {
		src := minimal + "[health]\ncommand = [\"/usr/local/sbin/ftkit-health\", \"{host}\"]\ninterval = \"" + tt.interval + "\"\ntimeout = \"" + tt.interval + "\"\n"
		c, err := ParseConfig([]byte(src))
		if tt.wantErr == "" {
			if err != nil {
				t.Errorf("interval %s: %v", tt.interval, err)
			}
			continue
		}
		if err == nil {
			t.Errorf("health.interval %s accepted: the agent would run the health command as root every %s", tt.interval, c.Health.Interval)
			continue
		}
		if !strings.Contains(err.Error(), tt.wantErr) {
			t.Errorf("interval %s: err = %v, want it to mention %q", tt.interval, err, tt.wantErr)
		}
	}
}
