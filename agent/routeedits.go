package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/restore"
	"github.com/ftkit/ftkit/restore/recovery"
)

// The route changes a recovery makes for its restore (the initial windows raised, the MTU lowered a byte:
// restore.SetInitCwnd, restore.LowerPathMTU) are kept in the state directory until they are put back. An
// agent killed in between left them for good: every later connection of the host, or of the job network,
// started with the restore's burst (tens of thousands of segments after a recovery under heavy traffic)
// into the site's network, over routes one byte short of their MTU. The next agent puts them back when it
// starts.

// routeEditsFile holds them, in the state directory (root only).
const routeEditsFile = "route-edits.json"

// maxRouteEditsFile bounds its read: a few hundred bytes per interface a recovery changed.
const maxRouteEditsFile = 4 << 20

// routeEdits is recovery.RouteKeeper on a file.
type routeEdits struct {
	path string
	log  *slog.Logger
	mu   sync.Mutex
	n    uint64 // names entries, with the time
	left map[string]routeEditEntry
}

type routeEditEntry struct {
	// Netns is the job network the routes are in; "" for the host's (the agent's own namespace).
	Netns string `json:"netns,omitempty"`
	restore.RouteEdit
}

func openRouteEdits(path string, log *slog.Logger) *routeEdits {
	return &routeEdits{path: path, log: log, left: map[string]routeEditEntry{}}
}

// Keep records edit until done is called. A nil k keeps nothing (agents built by tests).
func (k *routeEdits) Keep(netns string, edit restore.RouteEdit) (done func()) {
	if k == nil {
		return func() {}
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.n++
	id := strconv.FormatInt(time.Now().UnixNano(), 36) + "-" + strconv.FormatUint(k.n, 10)
	k.left[id] = routeEditEntry{Netns: netns, RouteEdit: edit}
	k.saveLocked()
	return sync.OnceFunc(func() {
		k.mu.Lock()
		defer k.mu.Unlock()
		delete(k.left, id)
		k.saveLocked()
	})
}

func (k *routeEdits) saveLocked() {
	if err := atomicfile.WriteJSON(k.path, k.left); err != nil {
		k.log.Warn("could not record a recovery's route changes: an agent restarted before they are put back leaves them", "err", err)
	}
}

// putBackLeft puts back what a previous agent changed and did not put back, and forgets each entry it
// could put back (a job network deleted since has nothing left). Call it before any recovery runs.
func (k *routeEdits) putBackLeft() error {
	if k == nil {
		return nil
	}
	b, err := atomicfile.ReadBounded(k.path, maxRouteEditsFile)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("route changes a previous agent left: %w", err)
	}
	var left map[string]routeEditEntry
	if err := json.Unmarshal(b, &left); err != nil {
		return fmt.Errorf("route changes a previous agent left, in %s: %w (put the routes' initcwnd, initrwnd, mtu and advmss back by hand, then remove the file)", k.path, err)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	var errs []error
	for id, e := range left {
		if err := recovery.PutBackEdit(e.Netns, e.RouteEdit); err != nil {
			errs = append(errs, err)
			k.left[id] = e // tried again at the next start
			continue
		}
		k.log.Info("put back the route changes a previous agent made for a restore", "netns", e.Netns, "iface", e.Iface,
			"initcwnd_routes", len(e.InitCwnd), "mtu_routes", len(e.MTU))
	}
	k.saveLocked()
	return errors.Join(errs...)
}
