package lab

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/lab/slurm"
)

// DefaultStateDir holds one JSON file per lab. It is on tmpfs on purpose: a reboot removes the namespaces,
// so it must forget the labs too.
const DefaultStateDir = "/run/ftkit/labs"

// Phase says how far Up got; Down treats every phase the same (it removes whatever exists).
type Phase string

const (
	PhaseCreating Phase = "creating"
	PhaseUp       Phase = "up"
)

// State is the on-disk record of a lab: the plan plus how far its creation got.
type State struct {
	Plan
	Phase Phase `json:"phase"`
	// Dirs are removed (recursively) by Down once every process of the lab is dead: agent state, job
	// directories, cgroup trees registered with AddCleanup.
	Dirs []string `json:"dirs,omitempty"`
	// Slurm is set when the lab runs Slurm (Config.Slurm): its daemons, recorded so Down stops them.
	Slurm *SlurmState `json:"slurm,omitempty"`
	// Owner is Config.Owner.
	Owner *slurm.Proc `json:"owner,omitempty"`
}

// stateStore reads and writes lab state files under one directory, serialised by an flock so that two
// concurrent `ftctl lab up` (or two tests) cannot both claim a subnet.
type stateStore struct{ dir string }

func (s stateStore) path(id string) string { return filepath.Join(s.dir, id+".json") }

// locked runs fn while holding the directory's lock.
func (s stateStore) locked(fn func() error) error {
	if err := os.MkdirAll(s.dir, 0o755); err != nil {
		return fmt.Errorf("create lab state dir %s: %w", s.dir, err)
	}
	f, err := os.OpenFile(filepath.Join(s.dir, ".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return fmt.Errorf("open lab lock: %w", err)
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		return fmt.Errorf("lock %s: %w", f.Name(), err)
	}
	defer unix.Flock(int(f.Fd()), unix.LOCK_UN) //nolint:errcheck // closing the file releases it anyway
	return fn()
}

// load returns the state of lab id, or fs.ErrNotExist wrapped.
func (s stateStore) load(id string) (State, error) {
	b, err := os.ReadFile(s.path(id))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return State{}, fmt.Errorf("no lab %q is up (no %s): %w", id, s.path(id), err)
		}
		return State{}, fmt.Errorf("read lab state: %w", err)
	}
	var st State
	if err := json.Unmarshal(b, &st); err != nil {
		return State{}, fmt.Errorf("lab state %s is corrupt (%v); remove leftovers by hand with `ip netns` and `ip link`", s.path(id), err)
	}
	return st, nil
}

// save writes the state atomically so a crash never leaves a torn file.
func (s stateStore) save(st State) error {
	return atomicfile.WriteJSON(s.path(st.ID), st)
}

func (s stateStore) remove(id string) error {
	if err := os.Remove(s.path(id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove lab state: %w", err)
	}
	return nil
}

// all lists the states of every lab on this machine, sorted by id.
func (s stateStore) all() ([]State, error) {
	entries, err := os.ReadDir(s.dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("list labs: %w", err)
	}
	var out []State
	for _, e := range entries {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || e.IsDir() {
			continue
		}
		st, err := s.load(id)
		if err != nil {
			return nil, err
		}
		out = append(out, st)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out, nil
}
