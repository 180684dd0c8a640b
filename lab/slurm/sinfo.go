package slurm

import (
	"fmt"
	"strings"
)

// SinfoArgs make sinfo print one "NODE STATE" line per node, which ParseSinfo reads.
var SinfoArgs = []string{"--noheader", "--Node", "--format=%N %t"}

// ParseSinfo reads the output of `sinfo` with SinfoArgs into node -> compact state ("idle", "down*",
// "unk*", ...). A node listed twice (once per partition) must agree with itself.
func ParseSinfo(out string) (map[string]string, error) {
	states := map[string]string{}
	for i, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if len(f) != 2 {
			return nil, fmt.Errorf("sinfo line %d %q: want NODE STATE", i+1, line)
		}
		if prev, ok := states[f[0]]; ok && prev != f[1] {
			return nil, fmt.Errorf("sinfo line %d: node %s is both %s and %s", i+1, f[0], prev, f[1])
		}
		states[f[0]] = f[1]
	}
	return states, nil
}

// NotIdle lists the wanted nodes that are missing from states or not idle, as "node=state".
func NotIdle(states map[string]string, nodes []string) []string {
	var out []string
	for _, n := range nodes {
		s, ok := states[n]
		if !ok {
			s = "missing"
		}
		if s != "idle" {
			out = append(out, n+"="+s)
		}
	}
	return out
}
