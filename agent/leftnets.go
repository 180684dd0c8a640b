package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"path/filepath"
	"time"

	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/internal/tickgrid"
	"github.com/ftkit/ftkit/jobnet"
)

// A job network that could not be deleted (deleteJobNet) may hold its address on the wire. Only the
// agent's memory kept that address reserved: after a restart nothing deleted the network again, and a new
// job was given the address the left namespace still held. Such networks are recorded, with their
// addresses, in this agent's state directory; adopt tries each again and keeps the address of one that
// still cannot be deleted reserved. Only this agent's own record is read: where agents share /run/netns (a
// lab's hosts, and parallel labs with the same host names), a sweep of /run/netns by name deleted other
// agents' networks.

// leftNetsFile holds them, in the state directory (root only).
const leftNetsFile = "left-job-nets.json"

// maxLeftNets bounds the record (networks the kernel would not delete are rare: a full record means the
// host needs an operator), and maxLeftNetsFile its read.
const (
	maxLeftNets     = 4096
	maxLeftNetsFile = 1 << 20
)

// leftNet is a job network that could not be deleted: its job and its address (none if the caller did
// not know it), by the network's name.
type leftNet struct {
	Job  string       `json:"job"`
	Addr netip.Prefix `json:"addr"`
}

func (a *Agent) leftNetsPath() string { return filepath.Join(a.cfg.StateDir, leftNetsFile) }

// readLeftNets reads the record; none is an empty one.
func (a *Agent) readLeftNets() (map[string]leftNet, error) {
	path := a.leftNetsPath()
	b, err := atomicfile.ReadBounded(path, maxLeftNetsFile)
	if errors.Is(err, fs.ErrNotExist) {
		return map[string]leftNet{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the job networks this agent could not delete: %w", err)
	}
	left := map[string]leftNet{}
	if err := json.Unmarshal(b, &left); err != nil {
		return nil, fmt.Errorf("the job networks this agent could not delete, in %s: %w (delete them by hand with ip netns del, then remove the file)", path, err)
	}
	if len(left) > maxLeftNets {
		return nil, fmt.Errorf("%s names %d job networks, more than %d (delete them by hand with ip netns del, then remove the file)", path, len(left), maxLeftNets)
	}
	for name, l := range left {
		if jobnet.ValidName(name) != nil || !validJobID(l.Job) || (l.Addr.IsValid() && !l.Addr.Addr().Is4()) {
			return nil, fmt.Errorf("%s names job network %q of job %q with address %s, not one this agent makes (delete the networks it names by hand with ip netns del, then remove the file)", path, name, l.Job, l.Addr)
		}
	}
	return left, nil
}

// noteLeftNet records job network name as left (l: its job and address), or, with left false, as gone.
// It writes the file only when the record changes: every successful deletion comes here.
func (a *Agent) noteLeftNet(name string, l leftNet, left bool) {
	a.leftNetsMu.Lock()
	defer a.leftNetsMu.Unlock()
	nets, err := a.readLeftNets()
	if err != nil {
		// Not overwritten: the networks it names would be forgotten.
		a.log.Error("cannot update the record of the job networks this agent could not delete", "net", name, "left", left, "err", err)
		return
	}
	old, ok := nets[name]
	switch {
	case !left && !ok:
		return
	case !left:
		delete(nets, name)
	case ok && old.Job == l.Job && (old.Addr == l.Addr || !l.Addr.IsValid()):
		return // a caller that did not know the address does not drop the one recorded
	case !ok && len(nets) >= maxLeftNets:
		a.log.Error("too many job networks this agent could not delete: this one is not recorded, and after a restart its address may be handed out again; delete it by hand (ip netns del)",
			"net", name, "addr", l.Addr, "max", maxLeftNets)
		return
	default:
		if !l.Addr.IsValid() {
			l.Addr = old.Addr
		}
		nets[name] = l
	}
	if err := atomicfile.WriteJSON(a.leftNetsPath(), nets); err != nil {
		a.log.Error("could not record the job networks this agent could not delete: after a restart their addresses may be handed out again", "net", name, "left", left, "err", err)
	}
}

// retryLeftNets deletes the job networks a previous agent recorded as left, once adopt has read the job
// records and before anything here makes a job network, and keeps the address of each one that still
// cannot be deleted reserved. A network a running job's record names is that job's: it stays, and its
// record holds its address until the job ends and its network is deleted.
func (a *Agent) retryLeftNets(ctx context.Context) {
	a.leftNetsMu.Lock()
	nets, err := a.readLeftNets()
	a.leftNetsMu.Unlock()
	if err != nil {
		a.log.Error("cannot read the job networks a previous agent could not delete: their addresses may be handed out again", "err", err)
		return
	}
	for name, l := range nets {
		if a.runsInJobNet(name) || name != jobNetName(a.cfg.Name, l.Job) {
			a.noteLeftNet(name, leftNet{}, false)
			continue
		}
		a.log.Warn("deleting again a job network a previous agent could not delete", "job", l.Job, "net", name, "addr", l.Addr)
		if a.deleteJobNet(ctx, l.Job, &JobNet{Name: name, Addr: l.Addr}) == nil {
			continue // deleteJobNet dropped it from the record
		}
		// deleteJobNet keeps its address held.
		a.log.Error("a job network a previous agent could not delete still cannot be: its address stays reserved until an agent deletes it at its start; delete it by hand (ip netns del) and restart the agent",
			"job", l.Job, "net", name, "addr", l.Addr)
	}
}

// leftNetsEvery is how often a running agent tries again to delete the job networks it could not
// (retryLeftNetsNow); leftNetTry bounds each try, and leftNetsPerPass the tries of one pass.
const (
	leftNetsEvery   = time.Minute
	leftNetTry      = 10 * time.Second
	leftNetsPerPass = 16
)

// retryLeftNetsEvery runs retryLeftNetsNow each leftNetsEvery until ctx ends. Tried at start only, a
// network whose deletion failed for a while stayed on the wire with its address, and the address out of
// the pool, for as long as the agent ran.
func (a *Agent) retryLeftNetsEvery(ctx context.Context) {
	tickgrid.Every(ctx, leftNetsEvery, func() { a.retryLeftNetsNow(ctx) })
}

// retryLeftNetsNow tries once more to delete the recorded job networks, up to leftNetsPerPass of them, while
// this agent runs. A network a running job's record names is that job's, as at start; one a job may be
// using (being restored or ending here, lingering, processes in its cgroup) waits for a later pass. A
// deleted network gives its address back (releaseLeftAddr). A failure was logged by the deletion that
// first failed: not again here at each pass.
func (a *Agent) retryLeftNetsNow(ctx context.Context) {
	a.leftNetsMu.Lock()
	nets, err := a.readLeftNets()
	a.leftNetsMu.Unlock()
	if err != nil {
		a.log.Debug("cannot read the job networks this agent could not delete", "err", err) // logged where it was written
		return
	}
	tries := 0
	for name := range nets {
		if ctx.Err() != nil || tries >= leftNetsPerPass {
			return
		}
		if a.retryLeftNet(ctx, name) {
			tries++
		}
	}
}

// retryLeftNet tries again to delete recorded job network name, and reports whether it tried.
// a.leftRetryMu is held from the checks to the end of the deletion: a restore of the job that begins
// meanwhile waits in claimJobNet before it makes the network again, and is not cut short by this deletion.
func (a *Agent) retryLeftNet(ctx context.Context, name string) bool {
	a.leftRetryMu.Lock()
	defer a.leftRetryMu.Unlock()
	a.leftNetsMu.Lock()
	nets, err := a.readLeftNets()
	a.leftNetsMu.Unlock()
	if err != nil {
		return false
	}
	l, ok := nets[name]
	if !ok {
		return false // deleted meanwhile
	}
	if a.runsInJobNet(name) || name != jobNetName(a.cfg.Name, l.Job) {
		a.noteLeftNet(name, leftNet{}, false)
		return false
	}
	if a.mayUseJobNet(l.Job, name) {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, leftNetTry)
	defer cancel()
	if err := a.removeJobNetNamed(ctx, name); err != nil {
		a.holdLeftAddr(name, l.Addr) // once per network
		a.log.Debug("a job network this agent could not delete still cannot be", "job", l.Job, "net", name, "addr", l.Addr, "err", err)
		return true
	}
	a.noteLeftNet(name, leftNet{}, false)
	a.releaseLeftAddr(name)
	a.log.Info("deleted a job network this agent could not delete before: its address goes back to the pool", "job", l.Job, "net", name, "addr", l.Addr)
	return true
}

// waitLeftNetRetry waits until a retry of a left job network under way (retryLeftNet) has ended.
func (a *Agent) waitLeftNetRetry() {
	a.leftRetryMu.Lock()
	defer a.leftRetryMu.Unlock()
}

// mayUseJobNet says whether something of job id here may be using its network name: a restore of the job
// under way (it may have made the network already), the end of a copy being given back, a lingering
// network, or processes in the job's cgroup (a copy leaving this host, not killed yet).
func (a *Agent) mayUseJobNet(id, name string) bool {
	a.mu.Lock()
	_, restoring := a.restoring[id]
	ending := a.ending[id] != nil
	a.mu.Unlock()
	return restoring || ending || a.lingering.has(name) || populated(a.layout().cgroup(id))
}

// runsInJobNet says whether a running job's record of this agent names job network name.
func (a *Agent) runsInJobNet(name string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, j := range a.byID {
		if j.State == JobRunning && (jobNetName(a.cfg.Name, j.ID) == name || j.Net != nil && j.Net.Name == name) {
			return true
		}
	}
	return false
}
