package main

import (
	"context"
	"errors"
	"net/netip"
	"reflect"
	"strings"
	"testing"
)

func TestParseHostfile(t *testing.T) {
	tests := []struct {
		name, in string
		want     []string
		err      string
	}{
		{"one per line", "node1\nnode2\nnode3\n", []string{"node1", "node2", "node3"}, ""},
		{"Open MPI's form", "# the run\nnode1 slots=4\n\n  node2 slots=2 max_slots=8 # big one\nnode3\n", []string{"node1", "node2", "node3"}, ""},
		{"no trailing newline", "a.example\nb.example", []string{"a.example", "b.example"}, ""},
		{"empty", "# nothing\n\n", nil, "no hosts"},
		{"twice", "node1\nnode1 slots=2\n", nil, "listed twice"},
		{"an IP address", "10.0.0.1\n", nil, "IP address"},
		{"upper case", "Node1\n", nil, "may only contain"},
		{"unknown option", "node1 cpus=4\n", nil, "only slots"},
		{"bad slots", "node1 slots=x\n", nil, "positive number"},
		{"zero slots", "node1 slots=0\n", nil, "positive number"},
		{"too long", strings.Repeat("#", maxHostfile+1), nil, "longer than"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseHostfile(strings.NewReader(tt.in))
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("hosts %v, error %v; want an error about %q", got, err, tt.err)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("hosts %v, %v; want %v", got, err, tt.want)
			}
		})
	}
}

func TestSlurmHosts(t *testing.T) {
	expand := func(_ context.Context, list string) ([]string, error) {
		switch list {
		case "node[1-3],spare1":
			return []string{"node1", "node2", "node3", "spare1"}, nil
		case "node[1,1]":
			return []string{"node1", "node1"}, nil
		case "NODE1":
			return []string{"NODE1"}, nil
		}
		return nil, errors.New("Invalid hostlist")
	}
	tests := []struct {
		name string
		env  map[string]string
		want []string
		err  string
	}{
		{"allocation", map[string]string{"SLURM_JOB_NODELIST": "node[1-3],spare1", "SLURM_JOB_NUM_NODES": "4"}, []string{"node1", "node2", "node3", "spare1"}, ""},
		{"older Slurm's SLURM_NNODES", map[string]string{"SLURM_JOB_NODELIST": "node[1-3],spare1", "SLURM_NNODES": "4"}, []string{"node1", "node2", "node3", "spare1"}, ""},
		{"no count", map[string]string{"SLURM_JOB_NODELIST": "node[1-3],spare1"}, []string{"node1", "node2", "node3", "spare1"}, ""},
		{"not in Slurm", map[string]string{}, nil, "not inside a Slurm job"},
		{"count disagrees", map[string]string{"SLURM_JOB_NODELIST": "node[1-3],spare1", "SLURM_JOB_NUM_NODES": "3"}, nil, "says"},
		{"count not a number", map[string]string{"SLURM_JOB_NODELIST": "node[1-3],spare1", "SLURM_JOB_NUM_NODES": "four"}, nil, "says"},
		{"expansion fails", map[string]string{"SLURM_JOB_NODELIST": "node[1-"}, nil, "Invalid hostlist"},
		{"repeated node", map[string]string{"SLURM_JOB_NODELIST": "node[1,1]"}, nil, "twice"},
		{"not a member name", map[string]string{"SLURM_JOB_NODELIST": "NODE1"}, nil, "member names"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := slurmHosts(t.Context(), func(k string) string { return tt.env[k] }, expand)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("hosts %v, error %v; want an error about %q", got, err, tt.err)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("hosts %v, %v; want %v", got, err, tt.want)
			}
		})
	}
}

func TestSplitHosts(t *testing.T) {
	four := []string{"node1", "node2", "node3", "spare1"}
	tests := []struct {
		name          string
		np, spares    int
		ranks, spareH []string
		err           string
	}{
		{"every host a rank", 0, 0, four, []string{}, ""},
		{"one spare", 0, 1, four[:3], four[3:], ""},
		{"np within the non-spares", 2, 1, four[:2], four[3:], ""},
		{"two spares", 0, 2, four[:2], four[2:], ""},
		{"np beyond the non-spares", 4, 1, nil, nil, "--np 4"},
		{"negative np", -1, 0, nil, nil, "--np -1"},
		{"all spares", 0, 4, nil, nil, "--spares 4"},
		{"negative spares", 0, -1, nil, nil, "--spares -1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ranks, spares, err := splitHosts(four, tt.np, tt.spares)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("%v %v, error %v; want an error about %q", ranks, spares, err, tt.err)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(ranks, tt.ranks) || !reflect.DeepEqual(spares, tt.spareH) {
				t.Fatalf("ranks %v spares %v, %v; want %v %v", ranks, spares, err, tt.ranks, tt.spareH)
			}
		})
	}
}

func TestCoveringPrefix(t *testing.T) {
	addrs := func(ss ...string) []netip.Addr {
		var out []netip.Addr
		for _, s := range ss {
			out = append(out, netip.MustParseAddr(s))
		}
		return out
	}
	tests := []struct {
		name  string
		addrs []netip.Addr
		want  string
		err   string
	}{
		{"one host", addrs("10.1.2.3"), "10.1.2.3/32", ""},
		{"a lab", addrs("10.246.140.11", "10.246.140.12", "10.246.140.13", "10.246.140.101"), "10.246.140.0/25", ""},
		{"a /16", addrs("10.1.2.3", "10.1.200.4"), "10.1.0.0/16", ""},
		{"IPv6", addrs("fd00::1", "fd00::2"), "fd00::/126", ""},
		{"would hold loopback", addrs("10.1.2.3", "100.1.2.3"), "", "loopback"},
		{"mixed families", addrs("10.1.2.3", "fd00::1"), "", "families"},
		// A member's cluster address may be IPv4-mapped (the ring takes ::ffff:a.b.c.d for a.b.c.d): MPI's
		// interfaces have the IPv4 one.
		{"IPv4-mapped next to IPv4", addrs("::ffff:10.0.0.1", "10.0.0.2"), "10.0.0.0/30", ""},
		{"IPv4-mapped only", addrs("::ffff:10.0.0.1", "::ffff:10.0.0.2"), "10.0.0.0/30", ""},
		{"IPv4-mapped would hold loopback", addrs("::ffff:10.1.2.3", "::ffff:100.1.2.3"), "", "loopback"},
		{"none", nil, "", "no addresses"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := coveringPrefix(tt.addrs)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("%v, %v; want an error about %q", got, err, tt.err)
				}
				return
			}
			if err != nil || got.String() != tt.want {
				t.Fatalf("%v, %v; want %s", got, err, tt.want)
			}
		})
	}
}
