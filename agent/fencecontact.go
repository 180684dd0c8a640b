package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/internal/atomicfile"
)

// The self-fence's silence must outlive a restart of the agent: the protector waits from the last beat it
// received (fence.Timing.ReadyAt), so a restarted agent that counted its silence from its own start fenced
// a cut-off node up to the restart's delay after the restored copies went live elsewhere. The last contact
// is kept in the state dir on CLOCK_BOOTTIME (which runs on through suspend and agent restarts, unlike Go's
// monotonic clock), with the boot id: after a reboot the jobs are gone and the stamp means nothing.

// fenceContactFile holds the last contact with the ring neighbours (fenceContact) in the state dir.
const fenceContactFile = "fence-contact.json"

// maxFenceContactFile bounds what is read of it.
const maxFenceContactFile = 4 << 10

// fenceContactEvery is how often at most the last contact is written while it advances: a restart within
// it counts the silence from up to this much earlier, the safe side (the fence comes earlier, never later).
const fenceContactEvery = 250 * time.Millisecond

// fenceContact is the file's content: contact times as CLOCK_BOOTTIME nanoseconds of boot BootID.
type fenceContact struct {
	BootID    string `json:"boot_id"`
	Heard     int64  `json:"heard_boottime_ns"`      // the last contact with either ring neighbour
	ProtHeard int64  `json:"prot_heard_boottime_ns"` // the last contact with the protector alone
}

// contactStore keeps the self-fence's last contact across agent restarts. Its clock and boot id are
// fields for tests.
type contactStore struct {
	path     string
	boot     func() (string, error)        // the boot id
	boottime func() (time.Duration, error) // CLOCK_BOOTTIME
	written  neighbourSilence              // what was written last (heard, protHeard)
	at       time.Time                     // when
}

func newContactStore(path string) *contactStore {
	return &contactStore{path: path, boot: bootID, boottime: boottimeNow}
}

// bootID reads the kernel's id of this boot.
func bootID() (string, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return "", fmt.Errorf("read the boot id: %w", err)
	}
	id := strings.TrimSpace(string(b))
	if id == "" {
		return "", errors.New("read the boot id: empty")
	}
	return id, nil
}

// boottimeNow reads CLOCK_BOOTTIME.
func boottimeNow() (time.Duration, error) {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return 0, fmt.Errorf("read CLOCK_BOOTTIME: %w", err)
	}
	return time.Duration(ts.Nano()), nil
}

// load returns the silence a previous agent of this boot measured, its times on this process's monotonic
// clock as of now (zero neighbourSilence: none, or from another boot). A file it cannot use is logged by
// the caller, and the silence starts now as before.
func (s *contactStore) load(now time.Time) (neighbourSilence, error) {
	b, err := atomicfile.ReadBounded(s.path, maxFenceContactFile)
	if errors.Is(err, fs.ErrNotExist) {
		return neighbourSilence{}, nil
	}
	if err != nil {
		return neighbourSilence{}, fmt.Errorf("last contact a previous agent recorded: %w", err)
	}
	var c fenceContact
	if err := json.Unmarshal(b, &c); err != nil {
		return neighbourSilence{}, fmt.Errorf("last contact a previous agent recorded, in %s: %w", s.path, err)
	}
	boot, err := s.boot()
	if err != nil {
		return neighbourSilence{}, err
	}
	if c.BootID != boot {
		return neighbourSilence{}, nil // rebooted since: its jobs are gone
	}
	bt, err := s.boottime()
	if err != nil {
		return neighbourSilence{}, err
	}
	if c.Heard <= 0 || c.ProtHeard < 0 || c.ProtHeard > c.Heard || time.Duration(c.Heard) > bt {
		return neighbourSilence{}, fmt.Errorf("last contact a previous agent recorded, in %s: boottime %d (protector %d) is not before now (%d)", s.path, c.Heard, c.ProtHeard, bt)
	}
	// No contact with the protector alone (0) counts from the boot, as the oldest time there is. The file
	// keeps no contact with the predecessor alone: it is the last contact if the protector's was earlier, and
	// counts from the boot otherwise.
	w := neighbourSilence{heard: now.Add(time.Duration(c.Heard) - bt), protHeard: now.Add(time.Duration(c.ProtHeard) - bt), predHeard: now.Add(-bt)}
	if c.ProtHeard < c.Heard {
		w.predHeard = w.heard
	}
	return w, nil
}

// save records w's last contact as of now, at most every fenceContactEvery, and only when it changed.
func (s *contactStore) save(now time.Time, w neighbourSilence) error {
	if w.heard.IsZero() || w.heard.Equal(s.written.heard) && w.protHeard.Equal(s.written.protHeard) ||
		!s.at.IsZero() && now.Sub(s.at) < fenceContactEvery {
		return nil
	}
	boot, err := s.boot()
	if err != nil {
		return err
	}
	bt, err := s.boottime()
	if err != nil {
		return err
	}
	c := fenceContact{BootID: boot, Heard: int64(bt - now.Sub(w.heard))}
	if !w.protHeard.IsZero() {
		c.ProtHeard = min(max(int64(bt-now.Sub(w.protHeard)), 0), c.Heard)
	}
	if c.Heard <= 0 {
		return nil // contact before this boot's clock began: nothing to keep
	}
	s.written, s.at = neighbourSilence{heard: w.heard, protHeard: w.protHeard}, now
	if err := writeUnsynced(s.path, c); err != nil {
		return fmt.Errorf("record the last contact with the ring neighbours (a restarted agent would count its fence silence from its start): %w", err)
	}
	return nil
}

// writeUnsynced replaces path with v as JSON (0600) by a rename, without fsync: the stamp needs to outlive
// the agent's process only, which the page cache does, and a reboot voids it (boot id). Written up to four
// times a second, an fsync each time would be a disk flush the host pays for good.
func writeUnsynced(path string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	if err := os.Chmod(tmp, 0o600); err != nil { // a leftover of another mode is reused by WriteFile
		return err
	}
	return os.Rename(tmp, path)
}
