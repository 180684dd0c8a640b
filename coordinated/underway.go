package coordinated

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/internal/clustertls"
)

// Underway are the cuts this host coordinates that are neither committed nor given up, one file each in Dir
// ("": none kept). A restarted coordinator keeps its member incarnation, so no view declares it failed, and
// the cut under way lived only in the memory of its Snapshot call: its hosts held the run frozen, and their
// snapshot lock, until their hold's bound (10 minutes after the dump), and pinned its snapshots, their
// replication waiting for its commit, for 11. The restarted agent gives such cuts up (AbortLeft).
type Underway struct {
	Dir string
}

// underwayRecord is a cut under way as its file keeps it.
type underwayRecord struct {
	Run   string   `json:"run"`
	UID   uint32   `json:"uid"`
	Cut   string   `json:"cut"`
	Hosts []string `json:"hosts"`
}

func (u Underway) path(run string, uid uint32, cut string) string {
	return filepath.Join(u.Dir, fmt.Sprintf("%s.%d.%s.json", run, uid, cut))
}

// begin records cut of run of uid, whose hosts are about to be frozen for it.
func (u Underway) begin(run string, uid uint32, cut string, hosts []string) error {
	if u.Dir == "" {
		return nil
	}
	if err := os.MkdirAll(u.Dir, 0o700); err != nil {
		return fmt.Errorf("record cut %s of run %s as under way: %w", cut, run, err)
	}
	if err := atomicfile.WriteJSON(u.path(run, uid, cut), underwayRecord{Run: run, UID: uid, Cut: cut, Hosts: hosts}); err != nil {
		return fmt.Errorf("record cut %s of run %s as under way: %w", cut, run, err)
	}
	return nil
}

// end forgets cut of run of uid: given up on its hosts, or about to be committed.
func (u Underway) end(run string, uid uint32, cut string) error {
	if u.Dir == "" {
		return nil
	}
	if err := os.Remove(u.path(run, uid, cut)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("forget cut %s of run %s as under way: %w", cut, run, err)
	}
	return atomicfile.SyncDir(u.Dir)
}

// read reads and validates the record in path, as it would a member's.
func (u Underway) read(path string) (underwayRecord, error) {
	var r underwayRecord
	b, err := atomicfile.ReadBounded(path, clusterapi.MaxMessage)
	if err == nil {
		err = json.Unmarshal(b, &r)
	}
	if err == nil {
		err = clusterapi.CoordinateRequest{Run: r.Run, UID: &r.UID, Cut: r.Cut, Phase: clusterapi.CoordAbort}.Validate()
	}
	if err == nil && len(r.Hosts) > clusterapi.MaxCutParts {
		err = fmt.Errorf("%d hosts, at most %d", len(r.Hosts), clusterapi.MaxCutParts)
	}
	for _, h := range r.Hosts {
		if err == nil {
			err = clustertls.ValidateMemberName(h)
		}
	}
	return r, err
}

// AbortLeft gives up the cuts a previous agent coordinated and left under way (Underway): each of their
// hosts is sent the abort, which thaws the run's jobs there and gives back its snapshot lock (before the
// thaw), or unpins the cut's snapshots (after), then the record is removed. Best effort: a host that does
// not answer keeps the hold until its bound, as before. A cut whose commit was sent has no record: its
// commit may have reached some members, whose record needs the snapshots that the abort would unpin.
func (c *Coordinator) AbortLeft(ctx context.Context) {
	if c.Underway.Dir == "" {
		return
	}
	des, err := os.ReadDir(c.Underway.Dir)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			c.Log.Error("the coordinated snapshots a previous agent left under way cannot be listed: their hosts keep the runs frozen or their snapshots pinned until their bounds", "dir", c.Underway.Dir, "err", err)
		}
		return
	}
	for _, de := range des {
		if !strings.HasSuffix(de.Name(), ".json") || strings.HasPrefix(de.Name(), ".") || !de.Type().IsRegular() {
			continue
		}
		path := filepath.Join(c.Underway.Dir, de.Name())
		r, err := c.Underway.read(path)
		if err != nil {
			c.Log.Error("unreadable record of a coordinated snapshot a previous agent left under way: removed; its hosts keep it until their bounds", "file", path, "err", err)
		} else {
			c.Log.Warn("giving up the coordinated snapshot a previous agent left under way", "run", r.Run, "uid", r.UID, "cut", r.Cut, "hosts", r.Hosts)
			abort := clusterapi.CoordinateRequest{Run: r.Run, UID: &r.UID, Cut: r.Cut, Phase: clusterapi.CoordAbort}
			if _, err := c.onHosts(ctx, r.Hosts, func(string) clusterapi.CoordinateRequest { return abort }); err != nil {
				c.Log.Warn("the abort of a coordinated snapshot a previous agent left under way did not reach every host: those keep it until their bounds", "run", r.Run, "cut", r.Cut, "err", err)
			}
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			c.Log.Error("record of a coordinated snapshot a previous agent left under way not removed", "file", path, "err", err)
		}
	}
}
