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
