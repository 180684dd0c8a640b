// Package spare holds both sides of claiming a spare host for a failed node's jobs (RADIC's resilient
// mode): the spare's own claim state, and the order in which a requester tries the spares.
//
// RADIC resolves races between protectors by having each spare answer claims first-come-first-served and
// take at most one failed node: a second claim gets "busy", and so does a claim whose jobs would not fit.
// The claim is persisted, so a spare whose agent restarts mid-recovery still refuses other failures.
package spare

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/ring"
)

// ErrBusy is the spare's refusal: it already serves another failure or cannot hold the jobs. The
// requester should try the next spare (Order), or fall back to basic mode when none is left.
var ErrBusy = errors.New("spare busy")

// Need is what a failed node's jobs need on the spare.
type Need struct {
	Jobs        int   `json:"jobs"`
	MemoryBytes int64 `json:"memory_bytes"` // sum of the jobs' snapshot memory sizes
}

// Claim asks a spare to take one failed node's jobs.
type Claim struct {
	Failure string    `json:"failure"` // failure id: the same failure may be claimed again (retries)
	By      string    `json:"by"`      // requesting member
	Failed  string    `json:"failed"`  // failed node
	Need    Need      `json:"need"`
	At      time.Time `json:"at"` // when the spare took it, by the spare's own clock (never the requester's)
	// Spares are the spares of the failed node's run (its jobs' placement), when the claim is for them: an
	// alive node of the ring that runs no job accepts only a claim naming it here. Empty: a ring spare's claim.
	Spares []string `json:"spares,omitempty"`
	// Prefetch names the snapshot each job of the failed node will most likely be restored from, and the
	// member holding it: the claimed spare fetches them while the protector waits for the failed node's
	// fence, so that the transfer is done (or under way) when the recovery starts.
	Prefetch []Prefetch `json:"prefetch,omitempty"`
	// SpareIncarnation is the claimed member's own incarnation when it took the claim, set by the member
	// itself (never taken from the requester): a claim taken by an earlier incarnation ended when that
	// incarnation failed (the host dropped its jobs before it rejoined), and must not keep the spare busy.
	SpareIncarnation uint64 `json:"spare_incarnation,omitempty"`
}

// Prefetch is one snapshot a claimed spare may fetch ahead of its recovery.
type Prefetch struct {
	Job      string `json:"job"`
	Snapshot string `json:"snapshot"`
	Source   string `json:"source"`
}

// MaxRunSpares bounds Claim.Spares (a claim arrives from another agent).
const MaxRunSpares = 4096

// MaxPrefetch bounds Claim.Prefetch (one per job of the failed node, as a recovery request).
const MaxPrefetch = 1024

// maxFailure bounds a claim's failure id: a protector's is its failed node's name (at most 128 bytes, as
// any name in a snapshot id), '-' and the time it declared it (23 bytes); the spare's record of it,
// <id>.json, stays within a file name's 255 bytes.
const maxFailure = 200

// checkFailureID accepts a failure id the spare's agent can name its recovery record after
// (recoveries/<id>.json in its state directory, read when a later claim comes): printable ASCII without a
// path separator, not hidden, bounded. A claimer's id led the root agent to read a file of its choosing,
// and one no record can be saved under had the spare claimed for a recovery that could never run.
func checkFailureID(id string) error {
	if len(id) > maxFailure {
		return fmt.Errorf("claim with a failure id of %d bytes, at most %d", len(id), maxFailure)
	}
	bad := strings.HasPrefix(id, ".")
	for i := 0; i < len(id); i++ {
		if id[i] < 0x21 || id[i] > 0x7e || id[i] == '/' || id[i] == '\\' {
			bad = true
		}
	}
	if bad {
		return fmt.Errorf("claim with failure id %q: not usable as a file name (printable ASCII without '/', '\\' or a leading '.')", id)
	}
	return nil
}

func (c Claim) validate() error {
	if c.Failure == "" {
		return errors.New("claim without a failure id")
	}
	if err := checkFailureID(c.Failure); err != nil {
		return err
	}
	switch {
	case c.By == "":
		return fmt.Errorf("claim for failure %s without a requesting member", c.Failure)
	case c.Failed == "":
		return fmt.Errorf("claim for failure %s without a failed node", c.Failure)
	case c.Need.Jobs < 0 || c.Need.MemoryBytes < 0:
		return fmt.Errorf("claim for failure %s: negative need (%d jobs, %d bytes)", c.Failure, c.Need.Jobs, c.Need.MemoryBytes)
	case len(c.Spares) > MaxRunSpares:
		return fmt.Errorf("claim for failure %s names %d spares of the run, at most %d", c.Failure, len(c.Spares), MaxRunSpares)
	}
	for _, name := range c.Spares {
		if err := clustertls.ValidateMemberName(name); err != nil {
			return fmt.Errorf("claim for failure %s: a spare of the run: %w", c.Failure, err)
		}
	}
	if len(c.Prefetch) > MaxPrefetch {
		return fmt.Errorf("claim for failure %s names %d snapshots to prefetch, at most %d", c.Failure, len(c.Prefetch), MaxPrefetch)
	}
	for _, p := range c.Prefetch {
		if err := clustertls.ValidateMemberName(p.Source); err != nil {
			return fmt.Errorf("claim for failure %s: the holder of a snapshot to prefetch: %w", c.Failure, err)
		}
	}
	return nil
}

// Validate checks a claim received from another agent before any of it is used.
func (c Claim) Validate() error { return c.validate() }

// state is the persisted form; a nil Claim means free.
type state struct {
	Claim *Claim `json:"claim"`
}

// Holder is a spare's claim state, persisted at a path. It is safe for concurrent use; concurrent claims
// are served one at a time, so exactly one of several racing failures wins.
type Holder struct {
	path string
	mu   sync.Mutex
	cur  *Claim
}

// OpenHolder loads the claim state at path; a missing file means the spare is free. A file that cannot be
// read is an error, not "free": forgetting a claim could give the spare to two failures.
func OpenHolder(path string) (*Holder, error) {
	h := &Holder{path: path}
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return h, nil
	}
	if err != nil {
		return nil, fmt.Errorf("open spare claim: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var s state
	if err := dec.Decode(&s); err != nil {
		return nil, fmt.Errorf("spare claim %s is unreadable (%w); remove it only if this spare certainly serves no failure", path, err)
	}
	if s.Claim != nil {
		if err := s.Claim.validate(); err != nil {
			return nil, fmt.Errorf("spare claim %s: %w; remove it only if this spare certainly serves no failure", path, err)
		}
	}
	h.cur = s.Claim
	return h, nil
}

// Claim takes the spare for c if it is free and availableMemory covers c's need plus 10% headroom (the
// restored processes also need page tables, buffers and the restorer itself). Claiming again for the
// same failure succeeds without re-checking memory (the first claim's restore may already use it). The
// claim is on disk before Claim returns nil.
func (h *Holder) Claim(c Claim, availableMemory int64) error {
	if err := c.validate(); err != nil {
		return err
	}
	c.At = c.At.Round(0) // what is stored is what a restarted agent reads back
	h.mu.Lock()
	defer h.mu.Unlock()
	if cur := h.cur; cur != nil {
		if cur.Failure == c.Failure && cur.Failed == c.Failed {
			return nil
		}
		if cur.Failure == c.Failure {
			return fmt.Errorf("%w: failure %s is claimed here for node %s, not %s", ErrBusy, cur.Failure, cur.Failed, c.Failed)
		}
		return fmt.Errorf("%w: claimed by %s for failed node %s (failure %s) since %s", ErrBusy, cur.By, cur.Failed, cur.Failure, cur.At.Format(time.RFC3339))
	}
	if required, ok := withHeadroom(c.Need.MemoryBytes); !ok || availableMemory < required {
		return fmt.Errorf("%w: %d bytes available, the %d jobs of %s need %d bytes plus 10%% headroom (%d)",
			ErrBusy, availableMemory, c.Need.Jobs, c.Failed, c.Need.MemoryBytes, required)
	}
	if err := h.save(&c); err != nil {
		return err
	}
	h.cur = &c
	return nil
}

// Holds reports whether availableMemory covers need plus the 10% headroom a claim asks for, and what that
// is: a migration's target is held to what a spare is.
func Holds(availableMemory, need int64) (required int64, ok bool) {
	required, ok = withHeadroom(need)
	return required, ok && availableMemory >= required
}

// withHeadroom is need*1.1 rounded up; false if it does not fit in an int64.
func withHeadroom(need int64) (int64, bool) {
	extra := need / 10
	if need%10 != 0 {
		extra++
	}
	if need > math.MaxInt64-extra {
		return math.MaxInt64, false
	}
	return need + extra, true
}

// Current returns the claim the spare serves, if any.
func (h *Holder) Current() (Claim, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.cur == nil {
		return Claim{}, false
	}
	return *h.cur, true
}

// Release frees the spare from failure (the recovery gave up, or the spare became a node and its claim
// is now history in the membership view). Releasing a free spare succeeds, so a retried release is
// harmless; releasing another failure's claim is refused.
func (h *Holder) Release(failure string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.cur == nil {
		return nil
	}
	if h.cur.Failure != failure {
		return fmt.Errorf("release spare for failure %s: it is claimed for failure %s (failed node %s), not released", failure, h.cur.Failure, h.cur.Failed)
	}
	if err := h.save(nil); err != nil {
		return err
	}
	h.cur = nil
	return nil
}

func (h *Holder) save(c *Claim) error {
	if err := atomicfile.WriteJSON(h.path, state{Claim: c}); err != nil {
		return fmt.Errorf("persist spare claim: %w", err)
	}
	return nil
}

// Order returns the names of the alive spares to try, in the order given (the view's registration
// order: RADIC claims spares first-come-first-served), leaving out those already tried for this failure.
func Order(spares []ring.Member, tried map[string]bool) []string {
	var out []string
	for _, m := range spares {
		if m.Role == ring.RoleSpare && m.State == ring.StateAlive && !tried[m.Name] {
			out = append(out, m.Name)
		}
	}
	return out
}

// Target is one spare of a run to try.
type Target struct {
	Name string
	// Node: an alive node of the ring that runs no job (in a Slurm cluster every host is a node): the
	// failed node's addresses go to it and it keeps its ring position (ring.View.Absorb). Else a ring
	// spare, which takes the failed node's place (ring.View.Replace).
	Node bool
}

// RunOrder returns the spares of a run to try for failed node, in the run's order: those alive in v,
// neither failed itself nor already tried. The claimed member decides whether it is free.
func RunOrder(v ring.View, spares []string, failed string, tried map[string]bool) []Target {
	var out []Target
	for _, name := range spares {
		m, ok := v.Member(name)
		if !ok || m.State != ring.StateAlive || name == failed || tried[name] {
			continue
		}
		out = append(out, Target{Name: name, Node: m.Role == ring.RoleNode})
	}
	return out
}

// MemAvailable returns the kernel's estimate of memory available for new processes without swapping
// (MemAvailable in /proc/meminfo), the figure a claim's need is compared with.
func MemAvailable() (int64, error) { return readMemAvailable("/proc/meminfo") }

func readMemAvailable(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, fmt.Errorf("available memory: %w", err)
	}
	defer f.Close()
	n, err := parseMemAvailable(f)
	if err != nil {
		return 0, fmt.Errorf("available memory from %s: %w", path, err)
	}
	return n, nil
}

func parseMemAvailable(r io.Reader) (int64, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), "MemAvailable:")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) != 2 || f[1] != "kB" {
			return 0, fmt.Errorf("unexpected line %q", sc.Text())
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil || kb < 0 || kb > math.MaxInt64/1024 {
			return 0, fmt.Errorf("unexpected line %q", sc.Text())
		}
		return kb * 1024, nil
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, errors.New("no MemAvailable line (kernel older than 3.14?)")
}
