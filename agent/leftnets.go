package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/netip"
	"path/filepath"

	"github.com/ftkit/ftkit/internal/atomicfile"
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
		a.holdLeftAddr(l.Addr)
		a.log.Error("a job network a previous agent could not delete still cannot be: its address stays reserved until an agent deletes it at its start; delete it by hand (ip netns del) and restart the agent",
			"job", l.Job, "net", name, "addr", l.Addr)
	}
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
