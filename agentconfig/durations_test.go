package agentconfig

import (
	"strings"
	"testing"
	"time"
)

// A lost job keeps its snapshots 7 × checkpoint.keep_ended (agent lostFactor): a keep_ended whose 7 times
// overflows a time.Duration wraps to a negative age, and the next pass of forgetEnded deletes, here and on
// the protectors, the very snapshots of the lost jobs an operator meant to keep longest. Such a value must be
// refused; "0s" keeps them for good.
func TestKeepEndedLostJobsDoNotOverflow(t *testing.T) {
	for _, tt := range []struct{ keep, wantErr string }{
		{"24h", ""},
		{"0s", ""},
		{"8760h", ""}, // a year
		{"400000h", "checkpoint.keep_ended 400000h0m0s"}, // 45 years: × 7 wraps to a negative duration
		{"2562047h", "checkpoint.keep_ended"},            // the longest time.Duration
	} {
		c, err := ParseConfig([]byte(minimal + "[checkpoint]\nkeep_ended = \"" + tt.keep + "\"\n"))
		if tt.wantErr == "" {
			if err != nil {
				t.Errorf("keep_ended %s: %v", tt.keep, err)
			}
			continue
		}
		if err == nil {
			keep := c.Checkpoint.KeepEnded.Duration
			t.Errorf("keep_ended %s accepted: a lost job would keep its snapshots 7 × %s, which wraps to %s", tt.keep, keep, 7*keep)
			continue
		}
		if !strings.Contains(err.Error(), tt.wantErr) {
			t.Errorf("keep_ended %s: err = %v, want it to mention %q", tt.keep, err, tt.wantErr)
		}
	}
}

// The agent's watch over its predecessor, its self-fence check and its stall monitor tick every half
// heartbeat.interval (tickgrid), and it sends a beat every interval. An interval of a few nanoseconds (a
// typo: "500ns" or "500us" for "500ms") turned them into busy loops, 1ns into a period of 0 that tickgrid
// runs back to back, and flooded the protector with beats: it must be refused, not accepted.
func TestHeartbeatIntervalNotABusyLoop(t *testing.T) {
	for _, tt := range []struct{ interval, wantErr string }{
		{"500ms", ""},
		{"20ms", ""}, // faster than the lab's fast detection (75 ms)
		{"10ms", ""},
		{"500us", "heartbeat.interval 500µs"},
		{"500ns", "heartbeat.interval 500ns"},
		{"1ns", "heartbeat.interval 1ns"},
	} {
		c, err := ParseConfig([]byte(minimal + "[heartbeat]\ninterval = \"" + tt.interval + "\"\ntimeout = \"1s\"\n"))
		if tt.wantErr == "" {
			if err != nil {
				t.Errorf("interval %s: %v", tt.interval, err)
			}
			continue
		}
		if err == nil {
			iv := c.Heartbeat.Interval.Duration
			t.Errorf("heartbeat.interval %s accepted: the agent's loops would tick every %s and send %.0f beats a second", tt.interval, iv/2, float64(time.Second)/float64(iv))
			continue
		}
		if !strings.Contains(err.Error(), tt.wantErr) {
			t.Errorf("interval %s: err = %v, want it to mention %q", tt.interval, err, tt.wantErr)
		}
	}
}
