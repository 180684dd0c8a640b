package agent

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ftkit/ftkit/internal/heldconns"
)

// inFlightWait bounds how long a semi-coordinated snapshot keeps the host's jobs frozen for the bytes in
// flight between them (awaitInFlight). A segment lost on loopback (a full backlog on a loaded host) is sent
// again after the retransmission timeout: 200 ms, then 400 ms more, and so on.
const inFlightWait = 3 * time.Second

// flowIn is one end of a connection of a frozen job, listed in network namespace netns ("" for the host's).
type flowIn struct {
	netns string
	heldconns.Flow
}

// inFlight names the directions of the connections between two of ends whose receiver has not received all
// that the sender sent. A direction has nothing in flight when the sender's bytes are all acknowledged, or
// when the receiver received as many bytes as the sender sent, and the sender's FIN if it sent one (a FIN
// counts in no byte count: one lost on loopback and acknowledged between the two dumps tore them). The
// second spares a wait for a delayed acknowledgment; the first decides where an end was restored, since its
// counts start at its restore (heldconns.Flow).
func inFlight(ends []flowIn) []string {
	by := make(map[connEnd]heldconns.Flow, len(ends))
	for _, e := range ends {
		by[endIn(e.netns, e.Conn)] = e.Flow
	}
	var out []string
	for _, e := range ends {
		r, ok := by[endIn(e.netns, e.Conn.Reverse())]
		if !ok || e.Unacked == 0 || e.Sent == r.Received && (!e.FinSent || r.FinReceived) {
			continue
		}
		out = append(out, fmt.Sprintf("%s -> %s: %d segment(s) unacknowledged", e.Conn.Local, e.Conn.Remote, e.Unacked))
	}
	slices.Sort(out)
	return out
}

// awaitInFlight waits, jobs frozen, until nothing is in flight on the connections between two of them
// (inFlight), for at most inFlightWait. Frozen jobs send nothing more, but their kernel still delivers and
// retransmits what they sent, and CRIU drops the packets of a job's connections while it dumps the job: a
// segment in flight at the first dump can reach its receiver after the receiver's dump and be acknowledged
// before the sender's. No snapshot then holds those bytes, and no log does either (loopback, or the host's
// job networks): the host's snapshot would be refused at a recovery (ci260). Past the bound the snapshot is
// skipped and the jobs' previous snapshots stay theirs.
func (a *Agent) awaitInFlight(ctx context.Context, jobs []Job) error {
	list, err := flowLister(jobs)
	if err != nil {
		return fmt.Errorf("semi-coordinated snapshot skipped, jobs thawed: %w", err)
	}
	waited, err := settle(ctx, list, inFlightWait)
	if err != nil {
		return fmt.Errorf("semi-coordinated snapshot skipped, jobs thawed: %w", err)
	}
	if waited > 10*time.Millisecond {
		a.log.Info("bytes in flight between frozen jobs arrived before their snapshot", "jobs", jobsOf(jobs), "waited_ms", waited.Milliseconds())
	}
	return nil
}

// settle lists the flows of frozen jobs (list) until nothing is in flight between them, for at most bound,
// and returns how long it waited.
func settle(ctx context.Context, list func() ([]flowIn, error), bound time.Duration) (time.Duration, error) {
	start := time.Now()
	for {
		ends, err := list()
		if err != nil {
			return time.Since(start), err
		}
		late := inFlight(ends)
		waited := time.Since(start)
		switch {
		case len(late) == 0:
			return waited, nil
		case waited > bound:
			return waited, fmt.Errorf("bytes sent between the jobs (%s) did not arrive within %s of their freeze, "+
				"and snapshots taken now would hold them in neither job; the previous snapshots stay (is the host's loopback dropping packets?)", strings.Join(late, "; "), bound)
		}
		select {
		case <-ctx.Done():
			return waited, ctx.Err()
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// flowLister returns a function that lists the flows of the connections of jobs, which are frozen: their
// sockets, read once here, stay the same.
func flowLister(jobs []Job) (func() ([]flowIn, error), error) {
	groups, nets := byNetns(jobs)
	socks := map[string]heldconns.Sockets{}
	for key, js := range groups {
		cgroups := make([]string, len(js))
		for i, j := range js {
			cgroups[i] = j.Cgroup
		}
		s, err := heldconns.Inodes(cgroups...)
		if err != nil {
			return nil, fmt.Errorf("list the sockets of jobs %s: %w", jobsOf(js), err)
		}
		socks[key] = s
	}
	return func() ([]flowIn, error) {
		var out []flowIn
		for key, s := range socks {
			var flows map[string][]heldconns.Flow
			if err := inJobNet(nets[key], func() (err error) { flows, err = heldconns.Flows(s); return err }); err != nil {
				return nil, fmt.Errorf("list the connections of jobs %s: %w", jobsOf(groups[key]), err)
			}
			for _, fs := range flows {
				for _, f := range fs {
					out = append(out, flowIn{key, f})
				}
			}
		}
		return out, nil
	}, nil
}
