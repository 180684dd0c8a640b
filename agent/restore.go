package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/ship"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/grant"
	"github.com/ftkit/ftkit/ring"
	"github.com/ftkit/ftkit/shim"
)

// RestoreRequest asks an agent to restore a job on its host from a snapshot.
type RestoreRequest struct {
	Snapshot string `json:"snapshot"`         // snapshot id
	Job      string `json:"job,omitempty"`    // job id; found from the snapshot id if empty
	Force    bool   `json:"force,omitempty"`  // restore even if the job's node answers and runs it
	Source   string `json:"source,omitempty"` // member to fetch the snapshot from if this host lacks it
}

// ErrCorruptSnapshot means the snapshot failed verification; the error names the file and the next older
// snapshot that verifies.
var ErrCorruptSnapshot = errors.New("snapshot failed verification")

// ErrJobAlive means the job still runs on its node, so restoring it would run it twice.
var ErrJobAlive = errors.New("job still running")

// Restore restores a job on this host from a snapshot: the manual restore of a job whose node is gone
// (the automatic fail-over with log replay lives in the restorer). A caller other than root may restore
// only its own jobs, and learns nothing of a snapshot it does not own: the owner is checked before any byte
// of the snapshot moves, and again from the verified job record. The restore claims the job's next
// incarnation from a majority of the members first, so that it never runs a second copy of a job that a
// fail-over (or another restore) already brought back.
func (a *Agent) Restore(ctx context.Context, req RestoreRequest, uid uint32) (*Job, error) {
	if req.Job == "" {
		req.Job = a.localJobOfSnapshot(req.Snapshot)
	}
	prefer := ""
	if req.Job == "" || !a.holdsSnapshot(req.Job, req.Snapshot) {
		if req.Job == "" || uid != 0 {
			loc, holder := a.findJobOfSnapshot(ctx, req.Snapshot, req.Source)
			switch {
			case loc.Job == "":
				return nil, fmt.Errorf("%w: snapshot %s is not held by %s or any member that answers; name the job with --job", ckpt.ErrNotFound, req.Snapshot, a.cfg.Name)
			case req.Job != "" && loc.Job != req.Job:
				return nil, fmt.Errorf("%w: snapshot %s is of job %s, not %s", ckpt.ErrNotFound, req.Snapshot, loc.Job, req.Job)
			case uid != 0 && (loc.UID == nil || *loc.UID != uid):
				// Before the fetch: another user's snapshot never reaches this host on this caller's behalf.
				return nil, fmt.Errorf("%w: snapshot %s (held by %s) is not of a job of uid %d", ErrNoJob, req.Snapshot, holder, uid)
			}
			req.Job, prefer = loc.Job, holder
		}
		if _, err := a.store.Manifest(req.Job, req.Snapshot); errors.Is(err, ckpt.ErrNotFound) || errors.Is(err, fs.ErrNotExist) {
			if err := a.fetch(ctx, req.Job, req.Snapshot, req.Source, prefer); err != nil {
				return nil, err
			}
		}
	}
	m, err := a.store.Verify(ctx, req.Job, req.Snapshot)
	if err != nil {
		return nil, a.corrupt(ctx, req, err)
	}
	j, err := a.snapshotJob(m)
	if err != nil {
		return nil, err
	}
	if j.ID != m.Job {
		return nil, fmt.Errorf("snapshot %s of job %s carries the job record of %q: refusing it", m.ID, m.Job, j.ID)
	}
	if uid != 0 && j.UID != uid {
		return nil, fmt.Errorf("%w: job %s belongs to uid %d", ErrNoJob, j.ID, j.UID)
	}
	if !req.Force {
		if err := a.refuseIfAlive(ctx, j); err != nil {
			return nil, err
		}
	}
	holder := newHolder("restore")
	n, err := a.claimForRestore(ctx, j, m, holder, req.Force)
	if err != nil {
		return nil, err
	}
	j.Incarnation = n
	defer a.setBusy("restore")()
	work, err := a.workCopy(m)
	if err != nil {
		a.giveBack(ctx, j.ID, n, holder, nil)
		return nil, err
	}
	restored, err := a.restoreJob(ctx, m, j, work)
	if err != nil {
		a.giveBackUnlessStarted(ctx, j, n, holder, err)
		return nil, err
	}
	return restored, nil
}

// claimForRestore claims the incarnation after the snapshot's (j.Incarnation+1) for a manual restore. With
// force, a refusal is overridden by claiming one past the newest incarnation the members recorded: the
// operator has made sure the job runs nowhere.
func (a *Agent) claimForRestore(ctx context.Context, j Job, m *ckpt.Manifest, holder string, force bool) (uint64, error) {
	snapshot, node := m.ID, m.Node
	n := j.Incarnation + 1
	err := a.claimIncarnation(ctx, j.ID, n, holder, node)
	var refused *grant.RefusedError
	if err != nil && force && errors.As(err, &refused) {
		n = max(n, refused.Record.Incarnation) + 1
		a.log.Warn("forced restore overrides the recorded incarnation", "job", j.ID, "recorded", refused.Record, "incarnation", n)
		err = a.claimIncarnation(ctx, j.ID, n, holder, node)
	}
	switch {
	case errors.As(err, &refused):
		return 0, fmt.Errorf("%w: %w; snapshot %s was taken by incarnation %d: restore a snapshot of the running incarnation, or, if the job certainly no longer runs there, restore with --force",
			ErrJobAlive, err, snapshot, j.Incarnation)
	case err != nil:
		return 0, fmt.Errorf("restore of job %s not allowed: %w; retry when more members answer", j.ID, err)
	}
	return n, nil
}

// maxJobRecord bounds the job record a snapshot carries: a few hundred bytes plus the job's argv and env.
const maxJobRecord = 4 << 20

// snapshotJob reads the job record a snapshot carries and validates it, with the manifest's paths, against
// this agent's layout: both come from whichever node took the snapshot.
func (a *Agent) snapshotJob(m *ckpt.Manifest) (Job, error) {
	var j Job
	b, err := readBounded(filepath.Join(a.store.Path(m.Job, m.ID), snapJob), maxJobRecord)
	if err == nil {
		err = json.Unmarshal(b, &j)
	}
	if err != nil {
		return Job{}, fmt.Errorf("snapshot %s has no usable job record: %w", m.ID, err)
	}
	if err := checkPeerJob(a.layout(), m, &j); err != nil {
		return Job{}, fmt.Errorf("%w; refusing to restore it", err)
	}
	return j, nil
}

func readBounded(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err == nil && int64(len(b)) > limit {
		err = fmt.Errorf("%s is larger than %d bytes", path, limit)
	}
	return b, err
}

// workCopy lays out the snapshot's images in a working directory that restoreJob removes.
func (a *Agent) workCopy(m *ckpt.Manifest) (string, error) {
	// One directory per attempt: a manual restore and a fail-over of the same snapshot may prepare on one
	// host at once, and the loser of the incarnation claim removes its own copy, never the winner's.
	var rnd [4]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return "", err
	}
	work := filepath.Join(a.cfg.StateDir, "restore", m.Job+"-"+m.ID+"-"+hex.EncodeToString(rnd[:]))
	if err := linkTree(filepath.Join(a.store.Path(m.Job, m.ID), snapImages), work); err != nil {
		return "", fmt.Errorf("prepare images for restore: %w", err)
	}
	return work, nil
}

// outputJournalDir is the directory of a restore's work directory where restoreOutputs keeps what it
// changes, until the restore succeeds.
const outputJournalDir = "output-journal"

// restoreJob puts the job's output files back to their snapshot sizes and restores the images in work
// under a new shim on this host; work is removed afterwards. A restore that fails leaves the output files
// as it found them.
func (a *Agent) restoreJob(ctx context.Context, m *ckpt.Manifest, j Job, work string) (*Job, error) {
	keepWork := false
	defer func() {
		if !keepWork {
			os.RemoveAll(work)
		}
	}()
	journal, err := a.restoreOutputs(m, j, filepath.Join(work, outputJournalDir))
	var pid int
	start := time.Now()
	if err == nil {
		a.protect(&j)
		pid, err = shim.Launch(ctx, a.self, shim.Spec{
			JobID: j.ID, Mode: shim.ModeRestore, ImagesDir: work, CRIU: a.criu.Binary, ExitFile: j.ExitPath(), Node: a.cfg.Name,
		}, a.shimLog(j.ID))
	}
	if err != nil {
		// Nothing runs: the next attempt, or an older snapshot, finds the files as they were.
		keepWork, err = a.undoOutputs(journal, m, err)
		return nil, err
	}
	journal.close()
	j.Node, j.PID, j.State, j.Exit, j.Restored = a.cfg.Name, pid, JobRunning, nil, m.ID
	if err := a.jobs.save(&j); err != nil {
		return nil, err
	}
	a.mu.Lock()
	a.byID[j.ID] = &j
	a.notify()
	a.mu.Unlock()
	a.log.Info("job restored", "job", j.ID, "snapshot", m.ID, "from_node", m.Node, "pid", pid, "restore_ms", time.Since(start).Milliseconds())
	return &j, nil
}

// corrupt turns a verification failure into an error that names the next older snapshot that verifies.
func (a *Agent) corrupt(ctx context.Context, req RestoreRequest, verr error) error {
	ids, _ := a.store.List(req.Job, "")
	older := false
	for _, id := range ids {
		if id == req.Snapshot {
			older = true
			continue
		}
		if older {
			if _, err := a.store.Verify(ctx, req.Job, id); err == nil {
				return fmt.Errorf("%w: %v; the next older verified snapshot is %s: restore that one with `ftctl restore --snapshot %s`", ErrCorruptSnapshot, verr, id, id)
			}
		}
	}
	return fmt.Errorf("%w: %v; no older snapshot of job %s verifies on %s", ErrCorruptSnapshot, verr, req.Job, a.cfg.Name)
}

// refuseIfAlive asks the job's node whether it still runs the job.
func (a *Agent) refuseIfAlive(ctx context.Context, j Job) error {
	if j.Node == a.cfg.Name {
		if cur, _, err := a.Job(j.ID, 0); err == nil && cur.State == JobRunning {
			return fmt.Errorf("%w: job %s runs on this host (pid %d)", ErrJobAlive, j.ID, cur.PID)
		}
		return nil
	}
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	r, err := a.Ping(pctx, j.Node)
	if err != nil {
		return nil // the node does not answer: that is the case manual restore is for
	}
	if slices.Contains(r.Jobs, j.ID) {
		return fmt.Errorf("%w: job %s still runs on %s, which answers; stop it first, or force", ErrJobAlive, j.ID, j.Node)
	}
	return nil
}

// locateAnswer tells which job a snapshot id a member holds belongs to, and its owner (from the job
// record in the snapshot), so that a restore can be refused before the snapshot is fetched.
type locateAnswer = clusterapi.LocateReply

// locateReply answers opLocate for a snapshot this host holds (an empty Job if it holds none).
func (a *Agent) locateReply(id string) locateAnswer {
	r := locateAnswer{ID: id, Job: a.localJobOfSnapshot(id)}
	if r.Job == "" {
		return r
	}
	if m, err := a.store.Manifest(r.Job, id); err == nil {
		if j, err := a.snapshotJob(m); err == nil && j.ID == r.Job {
			r.UID = &j.UID
		}
	}
	return r
}

// findJobOfSnapshot finds the job a snapshot id belongs to, and its owner, at the members that answer:
// only source if given, else the snapshot's node's protector first, then any alive member. Members are
// asked at once, and the first in that order that holds it wins as soon as every earlier one has said no
// (a dead member costs the wait only when nobody before it holds the snapshot). It returns the answer and
// the member that gave it (an empty Job if none holds it).
func (a *Agent) findJobOfSnapshot(ctx context.Context, id, source string) (locateAnswer, string) {
	members := a.fetchCandidates(id, source, "")
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	type result struct {
		i int
		r locateAnswer
	}
	results := make(chan result, len(members))
	for i, name := range members {
		go func() {
			r := a.remoteJobOfSnapshot(ctx, name, id)
			// What another node says is checked before it names a directory or an owner.
			if r.ID != id || ckpt.ValidName(r.Job) != nil {
				r = locateAnswer{}
			}
			results <- result{i, r}
		}()
	}
	answers := make([]*locateAnswer, len(members))
	for range members {
		res := <-results
		answers[res.i] = &res.r
		for i, r := range answers {
			if r == nil {
				break
			}
			if r.Job != "" {
				return *r, members[i]
			}
		}
	}
	return locateAnswer{}, ""
}

func (a *Agent) localJobOfSnapshot(id string) string {
	jobs, _ := a.store.Jobs()
	for _, job := range jobs {
		if _, err := a.store.Manifest(job, id); err == nil {
			return job
		}
	}
	return ""
}

// holdsSnapshot reports whether this host's store has the snapshot (verified or not).
func (a *Agent) holdsSnapshot(job, id string) bool {
	_, err := a.store.Manifest(job, id)
	return err == nil
}

func (a *Agent) remoteJobOfSnapshot(ctx context.Context, member, id string) locateAnswer {
	r, err := a.peers().Locate(ctx, member, clusterapi.LocateRequest{ID: id})
	if err != nil || r.ID != id {
		return locateAnswer{}
	}
	return r
}

// fetch copies a snapshot from the member that holds it: source if given, else prefer (the member that
// said it holds it), the snapshot's node's protector (where replicas live), then any member that has it.
func (a *Agent) fetch(ctx context.Context, job, id, source, prefer string) error {
	if _, err := ckpt.ParseID(id); err != nil {
		return err
	}
	var errs []error
	for _, from := range a.fetchCandidates(id, source, prefer) {
		err := a.fetchFrom(ctx, from, job, id)
		if err == nil {
			return nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", from, err))
	}
	if len(errs) == 0 {
		errs = append(errs, errors.New("no other member is alive"))
	}
	return fmt.Errorf("fetch snapshot %s of job %s: %w", id, job, errors.Join(errs...))
}

// fetchCandidates orders the members to ask for snapshot id: only source if given, else prefer, the
// snapshot's node's protector, then the other alive members.
func (a *Agent) fetchCandidates(id, source, prefer string) []string {
	if source != "" {
		return []string{source}
	}
	var out []string
	add := func(name string) {
		if name != "" && name != a.cfg.Name && !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	add(prefer)
	v := a.View()
	if sid, err := ckpt.ParseID(id); err == nil {
		if p, ok := v.Protector(sid.Node); ok {
			add(p.Name)
		}
	}
	for _, m := range v.Members {
		if m.State == ring.StateAlive {
			add(m.Name)
		}
	}
	return out
}

func (a *Agent) fetchFrom(ctx context.Context, from, job, id string) error {
	fctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	c, err := a.peers().Fetch(fctx, from, clusterapi.FetchRequest{Job: job, ID: id})
	if err != nil {
		return err
	}
	defer c.Close()
	return a.receiveFetch(fctx, c, from, job, id)
}

// receiveFetch stores what arrives on a fetch connection to member from (the request for snapshot id of
// job already sent) if it is that snapshot: a member sends whatever it has under the name asked for, so
// anything else is refused before a file moves. The transfer sets its own deadlines: ship's idle timeout
// (a.wire.Idle only when a test shortens it), within ctx.
func (a *Agent) receiveFetch(ctx context.Context, c io.ReadWriter, from, job, id string) error {
	got, err := ship.Receive(ctx, c, a.store, ship.ReceiveOptions{Peer: from, Authorize: expectSnapshot(job, id), Logger: a.log, IdleTimeout: a.wire.Idle})
	if err != nil {
		return err
	}
	a.log.Info("snapshot fetched", "job", job, "snapshot", id, "from", from, "bytes", got.Bytes, "ms", got.Duration.Milliseconds())
	return nil
}

// expectSnapshot is the Authorize policy of a fetch: the manifest received must be the job and snapshot
// asked for, taken on the node the snapshot id names.
func expectSnapshot(job, id string) func(*ckpt.Manifest) error {
	node := ""
	if sid, err := ckpt.ParseID(id); err == nil {
		node = sid.Node
	}
	return func(m *ckpt.Manifest) error {
		if m.Job != job || m.ID != id {
			return fmt.Errorf("asked for snapshot %s of job %s, received %s of job %s", id, job, m.ID, m.Job)
		}
		if node != "" && m.Node != node {
			return fmt.Errorf("snapshot %s names node %s but its manifest says %s", id, node, m.Node)
		}
		return nil
	}
}

// serveFetch ships a snapshot this host holds to the member that asked for it.
func (a *Agent) serveFetch(ctx context.Context, c net.Conn, peer string, req clusterapi.FetchRequest) error {
	// The transfer sets its own deadlines: ship's idle timeout (a.wire.Idle only when a test shortens it).
	_, err := ship.Send(ctx, c, a.store, req.Job, req.ID, ship.SendOptions{Peer: peer, Logger: a.log, IdleTimeout: a.wire.Idle})
	return err
}

// linkTree hard-links (or copies, across file systems) every file of src into a fresh dst (0700), so
// that CRIU's restore log and image edits never touch the verified snapshot. Anything but regular files
// and directories is refused: a verified snapshot holds nothing else.
func linkTree(src, dst string) error {
	os.RemoveAll(dst)
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		target := filepath.Join(dst, rel)
		switch {
		case d.IsDir():
			return os.MkdirAll(target, 0o700)
		case !d.Type().IsRegular():
			return fmt.Errorf("%s is not a regular file", p)
		}
		if err := os.Link(p, target); err == nil {
			return nil
		}
		in, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
		if err != nil {
			return err
		}
		defer in.Close()
		st, err := in.Stat()
		if err != nil {
			return err
		}
		return copyPrefixToNew(target, in, st.Size())
	})
}
