package coordinated

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/atomicfile"
)

// Records are the cuts a host was told of: the newest of each run, as <run>.<uid>.json in Dir. Every
// alive member keeps them, so that any of them can roll a run back; a record is read as another member
// wrote it, and validated before any name in it is used.
type Records struct {
	Dir  string
	Host string // this host's name, for messages
	Log  *slog.Logger
}

// Run is a run of one user.
type Run struct {
	Name string
	UID  uint32
}

func (r Records) path(run string, uid uint32) string {
	return filepath.Join(r.Dir, fmt.Sprintf("%s.%d.json", run, uid))
}

// Save records c, unless a newer cut of its run is recorded (a commit that arrives late). A cut that Load
// would refuse is refused here: written, it would replace the run's previous record with none.
func (r Records) Save(c Cut) error {
	if err := (clusterapi.CoordinateRequest{Run: c.Run, UID: &c.UID, Cut: c.ID, Phase: clusterapi.CoordCommit, Parts: c.Parts}).Validate(); err != nil {
		return fmt.Errorf("record cut %s of run %s: %w", c.ID, c.Run, err)
	}
	if err := os.MkdirAll(r.Dir, 0o700); err != nil {
		return fmt.Errorf("record cut %s of run %s: %w", c.ID, c.Run, err)
	}
	// The look at the recorded cut and the write are one step: two commits at once (two coordinators' cuts)
	// both read the old record, and the older's write could replace the newer's.
	unlock, err := r.lock()
	if err != nil {
		return fmt.Errorf("record cut %s of run %s: %w", c.ID, c.Run, err)
	}
	defer unlock()
	if old, err := r.Load(c.Run, &c.UID); err == nil && old.ID >= c.ID {
		return nil // a newer cut's record arrived first (ids begin with the time)
	}
	b, err := json.MarshalIndent(c, "", "  ")
	if err == nil && len(b)+1 > maxRecord {
		err = fmt.Errorf("the record is %d bytes, a member reads at most %d", len(b)+1, maxRecord)
	}
	if err == nil {
		err = atomicfile.WriteFile(r.path(c.Run, c.UID), append(b, '\n'), 0o600)
	}
	if err != nil {
		return fmt.Errorf("record cut %s of run %s: %w", c.ID, c.Run, err)
	}
	return nil
}

// maxRecord bounds a cut record. A commit is at most clusterapi.MaxMessage on the wire, and its record,
// indented, is larger (some 60 bytes a part more): a bound of MaxMessage made the record of a large run's
// commit unreadable, the run left with no cut on that member.
const maxRecord = 2 * clusterapi.MaxMessage

// lock locks the records' directory until unlock: a look at a record and its write or removal are one
// step (a Records is a value, made anew for each use).
func (r Records) lock() (unlock func(), err error) {
	d, err := os.Open(r.Dir)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(d.Fd()), unix.LOCK_EX); err != nil {
		d.Close()
		return nil, fmt.Errorf("lock %s: %w", r.Dir, err)
	}
	return func() { d.Close() }, nil // and the lock with it
}

// Remove forgets cut, the cut of run of user uid recorded here, and reports whether it did: a newer cut
// of the run recorded since the caller looked (its commit came in between) stays, as it is the run's
// newest, and only, usable cut.
func (r Records) Remove(run string, uid uint32, cut string) (bool, error) {
	if err := clusterapi.ValidRunName(run); err != nil {
		return false, err
	}
	unlock, err := r.lock()
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil // no record at all
	}
	if err != nil {
		return false, fmt.Errorf("forget cut %s of run %s: %w", cut, run, err)
	}
	defer unlock()
	// An unreadable record is not the one the caller looked at either (All leaves it out): it stays.
	if cur, err := r.Load(run, &uid); err != nil || cur.ID != cut {
		return false, nil
	}
	if err := os.Remove(r.path(run, uid)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return false, fmt.Errorf("forget cut %s of run %s: %w", cut, run, err)
	}
	return true, nil
}

// Load reads the newest cut of run of user owner recorded here (nil: of the one user with a cut of a run
// of that name), and validates it as it came from another member.
func (r Records) Load(run string, owner *uint32) (*Cut, error) {
	if err := clusterapi.ValidRunName(run); err != nil {
		return nil, err
	}
	if owner == nil {
		var users []uint32
		for _, k := range r.Runs() {
			if k.Name == run {
				users = append(users, k.UID)
			}
		}
		switch len(users) {
		case 0:
			return nil, fmt.Errorf("%w of run %s is recorded on %s: take one with `ftctl checkpoint --run %s`", ErrNoCut, run, r.Host, run)
		case 1:
			owner = &users[0]
		default:
			slices.Sort(users)
			return nil, fmt.Errorf("%w: runs named %s of users %v have coordinated snapshots: name the user (--uid)", ErrRefused, run, users)
		}
	}
	b, err := atomicfile.ReadBounded(r.path(run, *owner), maxRecord)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w of run %s of uid %d is recorded on %s: take one with `ftctl checkpoint --run %s`", ErrNoCut, run, *owner, r.Host, run)
	}
	var c Cut
	if err == nil {
		err = json.Unmarshal(b, &c)
	}
	if err == nil && (c.Run != run || c.UID != *owner) {
		err = fmt.Errorf("it names run %s of uid %d", c.Run, c.UID)
	}
	if err == nil {
		err = clusterapi.CoordinateRequest{Run: c.Run, UID: &c.UID, Cut: c.ID, Phase: clusterapi.CoordCommit, Parts: c.Parts}.Validate()
	}
	if err != nil {
		return nil, fmt.Errorf("cut record of run %s on %s: %w", run, r.Host, err)
	}
	return &c, nil
}

// Runs are the runs with a cut recorded here.
func (r Records) Runs() []Run {
	des, err := os.ReadDir(r.Dir)
	if err != nil {
		return nil
	}
	var out []Run
	for _, de := range des {
		name, ok := strings.CutSuffix(de.Name(), ".json")
		i := strings.LastIndexByte(name, '.')
		if !ok || i < 0 || !de.Type().IsRegular() {
			continue
		}
		uid, err := strconv.ParseUint(name[i+1:], 10, 32)
		if err != nil || clusterapi.ValidRunName(name[:i]) != nil {
			continue
		}
		out = append(out, Run{name[:i], uint32(uid)})
	}
	return out
}

// All are the cuts recorded here, one per run; an unreadable record is logged and left out.
func (r Records) All() []*Cut {
	var out []*Cut
	for _, k := range r.Runs() {
		if c, err := r.Load(k.Name, &k.UID); err == nil {
			out = append(out, c)
		} else {
			r.Log.Warn("unreadable cut record", "run", k.Name, "uid", k.UID, "err", err)
		}
	}
	return out
}

// With is the recorded cut one of whose parts is job's, or nil.
func (r Records) With(job string) (*Cut, clusterapi.CutPart) {
	for _, c := range r.All() {
		for _, p := range c.Parts {
			if p.Job == job {
				return c, p
			}
		}
	}
	return nil, clusterapi.CutPart{}
}

// Pinned are job's snapshots that a cut recorded here names: retention keeps them.
func (r Records) Pinned(job string) []string {
	var out []string
	for _, c := range r.All() {
		for _, p := range c.Parts {
			if p.Job == job {
				out = append(out, p.Snapshot)
			}
		}
	}
	return out
}

// RollsBack reports whether job's run rolls back as a whole when the job's message-logging recovery
// fails (auto mode, and a cut of the run is recorded here).
func (r Records) RollsBack(job string) bool {
	c, p := r.With(job)
	return c != nil && p.Recovery == RecoveryAuto
}

// RollsBackAlone reports whether job's run can roll back as a whole without message logging
// (coordinated or auto mode, and a cut of the run is recorded here).
func (r Records) RollsBackAlone(job string) bool {
	c, p := r.With(job)
	return c != nil && (p.Recovery == RecoveryAuto || p.Recovery == RecoveryCoordinated)
}

// Coordinated reports whether a failure of job's host rolls its run back without trying message logging
// (coordinated mode, and a cut of the run is recorded here).
func (r Records) Coordinated(job string) bool {
	c, p := r.With(job)
	return c != nil && p.Recovery == RecoveryCoordinated
}
