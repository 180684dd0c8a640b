package ckpt

import (
	"fmt"
	"slices"

	"github.com/ftkit/ftkit/tcpflow"
)

// Part is one job's snapshot in a set of snapshots restored together: a coordinated cut, or the jobs of a
// failed node whose connections to each other crossed no logged interface.
type Part struct {
	Job   string
	Conns []Conn
}

// Mismatch is a connection that a restore of exactly a set of snapshots would not rebuild whole.
type Mismatch struct {
	Job  string // the job whose snapshot holds Conn
	Peer string // the job whose snapshot holds Conn's other end; "" if none of the set does
	Conn Conn
	Why  string // for a torn connection: which bytes are in neither snapshot, or in both but unwritten
}

// Match pairs each connection of parts that want selects (nil: every one) with its other end among parts
// and names those a restore of these snapshots alone cannot rebuild: the other end is in none of them, or
// the two snapshots disagree on the bytes between them. Every byte a sender wrote must be in its send queue
// (not yet acknowledged: it is sent again) or received by the other end, never neither (the receiver was
// dumped before the bytes arrived and the sender after their acknowledgment: nobody has them), and never
// received beyond what was written (the restored sender writes them again, unchecked). Snapshots of one
// freeze (a semi-coordinated node snapshot) always agree. A socket still connecting at its dump connects
// again once restored: it fits an other end that had not accepted it yet, and no other.
func Match(parts []Part, want func(Conn) bool) []Mismatch {
	type end struct {
		job  string
		part int
		c    Conn
	}
	ends := map[tcpflow.Tuple][]end{}
	// A job in a network namespace of its own holds its loopback connections whole, and another job's may
	// have the same 4-tuple (the same program, the same ephemeral port): an end is looked for in its own
	// job's snapshot first, which holds the other end if any snapshot does (a tuple is unique in a namespace).
	own := make([]map[tcpflow.Tuple]Conn, len(parts))
	for i, p := range parts {
		own[i] = make(map[tcpflow.Tuple]Conn, len(p.Conns))
		for _, c := range p.Conns {
			ends[c.Tuple] = append(ends[c.Tuple], end{p.Job, i, c})
			own[i][c.Tuple] = c
		}
	}
	var out []Mismatch
	for i, p := range parts {
		for _, s := range p.Conns {
			if want != nil && !want(s) {
				continue
			}
			var r end
			ok := false
			if c, mine := own[i][s.Reverse()]; mine {
				r, ok = end{p.Job, i, c}, true
			} else {
				// Not in another job that holds s's own 4-tuple too: that job is in a namespace of its
				// own, and its end pairs with its own copy of s (taken for s's, both were reported torn).
				for _, e := range slices.Backward(ends[s.Reverse()]) {
					if _, twin := own[e.part][s.Tuple]; !twin {
						r, ok = e, true
						break
					}
				}
			}
			switch {
			case s.Connecting && ok && !r.c.Connecting:
				out = append(out, Mismatch{Job: p.Job, Peer: r.job, Conn: s, Why: fmt.Sprintf("still connecting in job %s's snapshot, accepted in job %s's", p.Job, r.job)})
				continue
			case s.Connecting:
				continue // restored, it connects again to the restored listener
			case !ok:
				out = append(out, Mismatch{Job: p.Job, Conn: s, Why: "its other end is in none of the snapshots"})
				continue
			case r.c.Connecting:
				continue // said from the connecting end
			}
			// s sends to r: s has written up to OutqSeq, of which the last OutqLen bytes are not acknowledged.
			una, written, rcvd := s.OutqSeq-s.OutqLen, s.OutqSeq, r.c.InqSeq
			if s.FinUnacked {
				una-- // OutqSeq counts the FIN the job queued, OutqLen does not (Conn.FinUnacked)
			}
			switch {
			case int32(rcvd-una) < 0:
				out = append(out, Mismatch{Job: p.Job, Peer: r.job, Conn: s,
					Why: fmt.Sprintf("bytes %d..%d acknowledged by job %s after its dump, in neither snapshot", rcvd, una, r.job)})
			case int32(written-rcvd) < 0:
				out = append(out, Mismatch{Job: p.Job, Peer: r.job, Conn: s,
					Why: fmt.Sprintf("job %s received up to %d, beyond what job %s had written (%d)", r.job, rcvd, p.Job, written)})
			}
		}
	}
	return out
}
