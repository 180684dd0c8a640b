package slurm

import (
	"reflect"
	"strings"
	"testing"
)

func TestParseSinfo(t *testing.T) {
	for _, tc := range []struct {
		name    string
		out     string
		want    map[string]string
		wantErr string
	}{
		{"empty", "", map[string]string{}, ""},
		{"all idle", "node1 idle\nnode2 idle\nspare1 idle\n", map[string]string{"node1": "idle", "node2": "idle", "spare1": "idle"}, ""},
		{"registering", "node1 idle\nnode2 unk*\n", map[string]string{"node1": "idle", "node2": "unk*"}, ""},
		{"blank lines and padding", "\n  node1   down* \n\n", map[string]string{"node1": "down*"}, ""},
		{"node in two partitions, same state", "node1 idle\nnode1 idle\n", map[string]string{"node1": "idle"}, ""},
		{"node in two states", "node1 idle\nnode1 alloc\n", nil, "both"},
		{"a header", "NODELIST NODES STATE\n", nil, "want NODE STATE"},
		{"one field", "node1\n", nil, "want NODE STATE"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseSinfo(tc.out)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("ParseSinfo = %v, %v; want error %q", got, err, tc.wantErr)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("ParseSinfo = %v, %v; want %v", got, err, tc.want)
			}
		})
	}
}

func TestNotIdle(t *testing.T) {
	states := map[string]string{"node1": "idle", "node2": "down*", "spare1": "idle"}
	for _, tc := range []struct {
		nodes []string
		want  []string
	}{
		{[]string{"node1", "spare1"}, nil},
		{[]string{"node1", "node2"}, []string{"node2=down*"}},
		{[]string{"node3", "node1"}, []string{"node3=missing"}},
	} {
		if got := NotIdle(states, tc.nodes); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("NotIdle(%v) = %v, want %v", tc.nodes, got, tc.want)
		}
	}
}

// FuzzParseSinfo: whatever sinfo prints, the parser does not panic, and what it accepts holds only
// single-word node names and states.
func FuzzParseSinfo(f *testing.F) {
	for _, s := range []string{"", "node1 idle\n", "node1 idle\nnode1 alloc\n", "a b c\n", "\n\n x y", "node1\tdown*\r\n"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, out string) {
		states, err := ParseSinfo(out)
		if err != nil {
			return
		}
		for n, s := range states {
			if n == "" || s == "" || len(strings.Fields(n)) != 1 || len(strings.Fields(s)) != 1 {
				t.Fatalf("ParseSinfo(%q) accepted node %q state %q", out, n, s)
			}
		}
	})
}
