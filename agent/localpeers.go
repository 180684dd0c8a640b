package agent

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"slices"
	"strings"

	"github.com/ftkit/ftkit/internal/heldconns"
	"github.com/ftkit/ftkit/tcpflow"
)

// In semi-coordinated mode a snapshot of some of a host's jobs (a checkpoint of named jobs, a user's of
// their own, a recovery's re-protection of the jobs it restored) takes with it the jobs of the host they
// talk to: no log holds what crosses the host's own interface, so only snapshots of one freeze agree on
// it (ckpt.Match). Taken alone, the named job's snapshot was torn against its peers' older replicas: a
// failure of the host before its next scheduled freeze refused them all.

// heldBy is what one job's sockets hold, listed in its network namespace ("" for the host's).
type heldBy struct {
	job, netns string
	conns      []tcpflow.Tuple
}

// connEnd is one end of a connection between jobs of one host, as the other end finds it (endIn).
type connEnd struct {
	netns string
	t     tcpflow.Tuple
}

// endIn is the end of connection t held in network namespace netns ("" for the host's): only a loopback
// connection is private to its namespace, so the other end of any other is found by its tuple alone.
func endIn(netns string, t tcpflow.Tuple) connEnd {
	if !t.Local.Addr().IsLoopback() {
		netns = ""
	}
	return connEnd{netns, t}
}

// localPeerIDs returns the jobs not in in that hold the other end of a connection of a job in in, sorted.
// Two jobs that hold the two ends of one connection are on one host (held lists one host's jobs); only a
// loopback connection is private to a network namespace.
func localPeerIDs(in map[string]bool, held []heldBy) []string {
	holder := map[connEnd]string{}
	for _, h := range held {
		if !in[h.job] {
			for _, t := range h.conns {
				holder[endIn(h.netns, t)] = h.job
			}
		}
	}
	var out []string
	for _, h := range held {
		if !in[h.job] {
			continue
		}
		for _, t := range h.conns {
			if p, ok := holder[endIn(h.netns, t.Reverse())]; ok && !slices.Contains(out, p) {
				out = append(out, p)
			}
		}
	}
	slices.Sort(out)
	return out
}

// localPeers returns the running jobs of this host, other than jobs, that hold the other end of one of
// jobs' connections now. A peer being replayed by its recovery is an error (ErrReplaying): its snapshot
// waits for the replay's check, and one of jobs taken without it would be torn against it.
func (a *Agent) localPeers(jobs []Job) ([]Job, error) {
	in := map[string]bool{}
	for _, j := range jobs {
		in[j.ID] = true
	}
	byID := map[string]Job{}
	var running []Job
	for _, j := range a.Jobs(0) {
		if j.State == JobRunning {
			byID[j.ID] = j
			running = append(running, j)
		}
	}
	groups, nets := byNetns(running)
	var held []heldBy
	for key, js := range groups {
		socks := heldconns.Sockets{}
		for _, j := range js {
			s, err := heldconns.Inodes(j.Cgroup)
			switch {
			case err == nil:
				maps.Copy(socks, s)
			case !in[j.ID] && errors.Is(err, fs.ErrNotExist):
				// It ended meanwhile: nothing of it to take along.
			default:
				return nil, fmt.Errorf("list the sockets of job %s: %w", j.ID, err)
			}
		}
		var conns map[string]heldconns.Held
		err := inJobNet(nets[key], func() (err error) { conns, err = heldconns.List(socks); return err })
		switch {
		case key != "" && !in[js[0].ID] && errors.Is(err, fs.ErrNotExist):
			continue // the network of a job (its own) that ended meanwhile
		case err != nil:
			return nil, fmt.Errorf("list the connections of this host's jobs: %w", err)
		}
		for _, j := range js {
			held = append(held, heldBy{job: j.ID, netns: key, conns: conns[j.Cgroup].Conns})
		}
	}
	var peers []Job
	for _, id := range localPeerIDs(in, held) {
		if a.replays.has(id) {
			return nil, fmt.Errorf("job(s) %s talk to job %s of this host, whose recovery is replaying its peers' bytes: their snapshots must be taken together, once the replay is checked: %w", jobsOf(jobs), id, ErrReplaying)
		}
		peers = append(peers, byID[id])
	}
	return peers, nil
}

// jobsOf names jobs for a message.
func jobsOf(jobs []Job) string {
	ids := make([]string, len(jobs))
	for i, j := range jobs {
		ids[i] = j.ID
	}
	return strings.Join(ids, ", ")
}

// peerError is a failure of a snapshot at a job taken along with the jobs asked for (localPeers), which
// may be another user's: that user is told of it without what the job is (peerErrorFor).
type peerError struct{ err error }

func (e *peerError) Error() string { return e.err.Error() }
func (e *peerError) Unwrap() error { return e.err }

// peerErrorFor is what uid is told of err: for a non-root caller, a failure at a job taken along is named
// by what it means for theirs, and logged in full.
func (a *Agent) peerErrorFor(uid uint32, err error) error {
	var pe *peerError
	if uid == 0 || !errors.As(err, &pe) {
		return err
	}
	a.log.Warn("a user's snapshot failed at a job of this host that theirs talk to", "uid", uid, "err", err)
	if errors.Is(err, ErrReplaying) {
		return fmt.Errorf("snapshot skipped: a job of this host that yours talk to is being recovered, and must be snapshotted with them: %w", ErrReplaying)
	}
	return errors.New("snapshot skipped: a job of this host that yours talk to could not be frozen or snapshotted with them (the agent's log says why)")
}
