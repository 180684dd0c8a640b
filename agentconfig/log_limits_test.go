package agentconfig

import (
	"strings"
	"testing"
)

// A size in MiB the agent cannot use must be refused by Validate (and so by ftagent --check-config), not
// at the agent's start: ring_mib is a power of two the eBPF ring buffers take only up to 2 GiB
// (ebpfprobes' checkRingSize), and a size whose bytes overflow int64 wraps to a cap of 0 or less.
func TestLogSizesTheAgentCanUse(t *testing.T) {
	for _, tt := range []struct{ extra, wantErr string }{
		{"[log]\nring_mib = 2048\n", ""},
		{"[log]\nring_mib = 4096\n", "log.ring_mib 4096"},
		{"[log]\nring_mib = 17592186044416\n", "log.ring_mib 17592186044416"}, // 2^44: << 20 is 0, the default
		{"[log]\nmemory_mib = 8796093022208\n", "log.memory_mib"},             // 2^43: << 20 is negative
		{"[log]\npark_mib = 17592186044416\n", "log.park_mib"},                // 2^44: << 20 is 0, the default
	} {
		_, err := ParseConfig([]byte(minimal + tt.extra))
		if tt.wantErr == "" && err != nil {
			t.Errorf("%q: %v", tt.extra, err)
		}
		if tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
			t.Errorf("%q: err = %v, want it to mention %q", tt.extra, err, tt.wantErr)
		}
	}
}

// log.pessimistic and log.receive_positions act only on recorded receive order (agent: record.Options
// Record is log.enabled && log.receive_order): asked for without it, the safety they promise (no orphans;
// MPI_Waitany replayed) is silently absent.
func TestLogOptionsThatNeedReceiveOrder(t *testing.T) {
	for _, tt := range []struct{ extra, wantErr string }{
		{"[log]\npessimistic = true\nreceive_positions = true\n", ""},
		{"[log]\nenabled = false\n", ""},
		{"[log]\nreceive_order = false\n", ""},
		{"[log]\nreceive_order = false\npessimistic = true\n", "log.pessimistic"},
		{"[log]\nenabled = false\npessimistic = true\n", "log.pessimistic"},
		{"[log]\nreceive_order = false\nreceive_positions = true\n", "log.receive_positions"},
	} {
		_, err := ParseConfig([]byte(minimal + tt.extra))
		if tt.wantErr == "" && err != nil {
			t.Errorf("%q: %v", tt.extra, err)
		}
		if tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
			t.Errorf("%q: err = %v, want it to mention %q", tt.extra, err, tt.wantErr)
		}
	}
}
