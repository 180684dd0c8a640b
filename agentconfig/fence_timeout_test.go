package agentconfig

import (
	"strings"
	"testing"
)

// A node kills its protected jobs after fence_timeout of silence, but its protector declares it failed (and
// restores those jobs) only after heartbeat.timeout plus a direct probe of up to heartbeat.probe_timeout.
// A probe_timeout longer than heartbeat.timeout must not leave a window in which the node has killed its
// jobs while its protector, whose probe then succeeds, clears it: nobody restores them.
func TestFenceTimeoutCoversProbeTimeout(t *testing.T) {
	for _, tt := range []struct {
		name, extra, wantErr string
	}{
		// timeout 3s + probe 10s = 13s before a declaration; fence_timeout 7s kills the jobs first.
		{"explicit fence timeout below timeout + probe_timeout", "[heartbeat]\nprobe_timeout = \"10s\"\n[failover]\nfence_timeout = \"7s\"\n", "probe_timeout"},
		// Without fence_timeout, the default must cover the probe too (or the config be refused).
		{"default fence timeout with a long probe", "[heartbeat]\nprobe_timeout = \"10s\"\n", ""},
		// Confirmation takes up to 2 × probe_timeout in the loop systemd's watchdog checks every 30 s.
		{"probe longer than the watchdog allows", "[heartbeat]\nprobe_timeout = \"11s\"\n", "must be at most 10s"},
		{"heartbeat timeout taken as the probe's", "[heartbeat]\ntimeout = \"12s\"\n", "must be at most 10s"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c, err := ParseConfig([]byte(minimal + tt.extra))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want a refusal mentioning %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if ft, declare := c.FenceTiming().Timeout, c.Heartbeat.Timeout.Duration+c.ProbeTimeout(); ft < declare {
				t.Fatalf("fence timeout %s is shorter than heartbeat.timeout + probe_timeout (%s): the node kills its jobs before its protector can declare it failed", ft, declare)
			}
		})
	}
}

// checkpoint.mtbf is what a job's interval "auto" is computed from, and any job may ask for auto
// (CheckJobInterval) whatever the agent's own interval: a non-positive mtbf must be refused, not left to
// the scheduler (policyFor logs an error and falls back to a fixed minute).
func TestMTBFCheckedForJobsAskingAuto(t *testing.T) {
	c, err := ParseConfig([]byte(minimal + "[checkpoint]\nmtbf = \"-1h\"\n"))
	if err == nil && c.CheckJobInterval("auto") == nil {
		t.Fatalf("checkpoint.mtbf -1h accepted with a fixed interval, and a job's interval \"auto\" accepted too (it has no MTBF to use)")
	}
}
