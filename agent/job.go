package agent

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/internal/rlimits"
	"github.com/ftkit/ftkit/internal/rootpath"
	"github.com/ftkit/ftkit/shim"
)

// JobState is where a job is in its life.
type JobState string

const (
	JobRunning JobState = "running"
	JobExited  JobState = "exited"
	// JobLost: the job's process vanished without an exit record (killed with its shim, say).
	JobLost JobState = "lost"
	// JobMoved: the job was migrated to another host (MovedTo), where it runs on.
	JobMoved JobState = "moved"
)

// JobSpec is what a client asks the agent to run.
type JobSpec struct {
	Name     string   `json:"name,omitempty"`
	Argv     []string `json:"argv"`
	Env      []string `json:"env,omitempty"`
	Dir      string   `json:"dir,omitempty"`
	Interval string   `json:"interval,omitempty"` // "" (agent default), a duration, or "auto"
	// Placement is the job's own membership, from the allocation of the run it belongs to; nil: the
	// cluster ring decides (the ring successor protects, the ring's spares replace).
	Placement *Placement `json:"placement,omitempty"`
	// JobAddress asks for an address of the job's own on the cluster network (from the agent's
	// job_network.pool), which moves with the job when its host fails.
	JobAddress bool `json:"job_address,omitempty"`
	// Run names the run (the MPI job, the pipeline) the job is a part of: coordinated snapshots and
	// rollbacks take every running job of a run, on every host, together (package coordinated).
	Run string `json:"run,omitempty"`
	// Recovery is how a failure of the job's host is recovered: RecoveryLogging (the default), or, for a
	// job of a run with an address of its own, RecoveryCoordinated or RecoveryAuto.
	Recovery string `json:"recovery,omitempty"`
	// Limits are the resource limits the job starts with: those of the program that asked for it, which
	// the agent reads from its process (a client's own "limits" are not taken); none known, a login
	// session's (rlimits.Session).
	Limits []rlimits.Limit `json:"limits,omitempty"`
	// Umask is the file mode creation mask the job starts with: that of the program that asked for it,
	// which the agent reads from its process (as Limits); nil (unreadable, or a job recorded by an older
	// agent): 022, login's default. Never the agent's own, which its unit sets to 0077.
	Umask *uint32 `json:"umask,omitempty"`
}

// Recovery modes (JobSpec.Recovery).
const (
	// RecoveryLogging: only the failed host's jobs roll back; their peers' logs replay what they had
	// received (""; "message-logging" is accepted for it).
	RecoveryLogging = "message-logging"
	// RecoveryCoordinated: the whole run rolls back to its newest coordinated snapshot (the failed host's
	// jobs on a spare), which the run takes at the jobs' interval; no replay.
	RecoveryCoordinated = coordinated.RecoveryCoordinated
	// RecoveryAuto: message logging, and when a restored job's re-execution diverges (it re-sends other
	// bytes, or never what its peers had received), the coordinated rollback of the whole run.
	RecoveryAuto = coordinated.RecoveryAuto
)

// checkRecovery refuses a recovery mode the job cannot have.
func (s JobSpec) checkRecovery() error {
	switch s.Recovery {
	case "", RecoveryLogging:
		return nil
	case RecoveryCoordinated, RecoveryAuto:
		if s.Run == "" || !s.JobAddress {
			return fmt.Errorf("recovery %q rolls a whole run back: the job needs a run and an address of its own (ftwrap --run R --job-address, ftctl mpirun --job-addresses)", s.Recovery)
		}
		return nil
	}
	return fmt.Errorf("recovery %q: use %s, %s or %s", s.Recovery, RecoveryLogging, RecoveryCoordinated, RecoveryAuto)
}

// RollsBackRun reports whether a failure of the job's host may roll its whole run back.
func (s JobSpec) RollsBackRun() bool {
	return s.Run != "" && (s.Recovery == RecoveryCoordinated || s.Recovery == RecoveryAuto)
}

// MaxPlacementHosts bounds a placement's lists: a placement arrives from a user and from other agents.
const MaxPlacementHosts = 4096

// Placement is the membership of one run (a Slurm allocation, a hostfile): the member names its parts run
// on, in order, and the members it keeps idle to take a failed one's place. A job's protector is the next
// alive host of Hosts after its own; when its host fails, the first free one of Spares replaces it.
type Placement struct {
	Hosts  []string `json:"hosts"`
	Spares []string `json:"spares,omitempty"`
}

// Validate refuses placements no run can have: bad or repeated member names, a spare that also runs a
// part, lists beyond MaxPlacementHosts.
func (p *Placement) Validate() error {
	if p == nil {
		return nil
	}
	if len(p.Hosts) == 0 {
		return errors.New("placement: no hosts")
	}
	if n := len(p.Hosts) + len(p.Spares); n > MaxPlacementHosts {
		return fmt.Errorf("placement: %d hosts and spares, at most %d", n, MaxPlacementHosts)
	}
	seen := map[string]bool{}
	for _, h := range append(slices.Clone(p.Hosts), p.Spares...) {
		if err := clustertls.ValidateMemberName(h); err != nil {
			return fmt.Errorf("placement: %w", err)
		}
		if seen[h] {
			return fmt.Errorf("placement: %q appears twice (a host runs one part of a run, or is one of its spares)", h)
		}
		seen[h] = true
	}
	return nil
}

// Job is the agent's record of a protected job on this host, kept in <state_dir>/jobs/<id>.json.
type Job struct {
	ID       string           `json:"id"`
	Spec     JobSpec          `json:"spec"`
	UID      uint32           `json:"uid"`
	GID      uint32           `json:"gid"`
	Node     string           `json:"node"`
	PID      int              `json:"pid"` // host PID of the job's root (its PID-namespace init)
	State    JobState         `json:"state"`
	Exit     *shim.ExitStatus `json:"exit,omitempty"`
	Created  time.Time        `json:"created"`
	Cgroup   string           `json:"cgroup"`
	Dir      string           `json:"dir"` // cluster-wide job directory: stdout, stderr, exit
	Restored string           `json:"restored_from,omitempty"`
	// RestoredAt is when this host began the restore of the job, by its own clock (zero: never restored, or
	// a record written before it was kept).
	RestoredAt time.Time `json:"restored_at,omitzero"`
	// Replica is the job's newest snapshot that reached a protector; nil until the first one has.
	Replica *Replica `json:"replica,omitempty"`
	// Incarnation counts the job's restores: 0 as started, k+1 once restored from a snapshot of incarnation
	// k (a snapshot's job record carries the incarnation that took it). A majority of the members must
	// grant an incarnation before it runs, so that the job has exactly one live incarnation.
	Incarnation uint64 `json:"incarnation,omitempty"`
	// Net is the job's own network (JobSpec.JobAddress); nil: the job uses its host's. The address and
	// kind travel with the job's snapshots; the name is the namespace's on the host the job runs on.
	Net *JobNet `json:"net,omitempty"`
	// Fenced: this host's copy was killed because the job goes on elsewhere: self-fencing killed it (its
	// protector restores it), or it was a copy of this host's failed incarnation (rejoin). This agent must
	// not hand its address out again (addressHeld), and ftwrap follows the job on instead of ending.
	Fenced bool `json:"fenced,omitempty"`
	// MovedTo is the host the job was migrated to (state moved); Migration names that migration's event
	// and MovedSnapshot the dump the job left with, for an agent restarted before the move ended to finish
	// it (resumeMigrations).
	MovedTo       string `json:"moved_to,omitempty"`
	Migration     string `json:"migration,omitempty"`
	MovedSnapshot string `json:"moved_snapshot,omitempty"`
	// LazyWork is the images directory a lazily restored job's pages still come from (failover.lazy_restore);
	// its shim removes it once every page is in. The job is not snapshotted before: its missing pages would
	// be dumped as zeros.
	LazyWork string `json:"lazy_work,omitempty"`
	// NewConns names the connections the job opened after its replica was taken (and connections waiting
	// in its listeners' accept queues), as the agent's last check found them: a restore from the replica
	// could not rebuild them, so the job is not protected until its next snapshot, which comes soon.
	NewConns []string `json:"new_conns,omitempty"`
	// ConnsChecked is when the agent's last listing of the job's connections began.
	ConnsChecked time.Time `json:"conns_checked,omitzero"`
	// Ended is when an ended job's keep_ended began (its record's time when the agent first forgot its
	// snapshots, forget.go); Forget lists the holders of its replicas still to be told to drop them (or that
	// kept some; while it runs, the former holders of this host's replicas, recordReplica), and Forgotten says its snapshots are gone and its record stays (its address may be in use).
	Ended     time.Time `json:"ended,omitzero"`
	Forget    []string  `json:"forget,omitempty"`
	Forgotten bool      `json:"forgotten,omitempty"`
}

// startedHere bounds, on this host's clock, when j's oldest restore point may have been taken (the log
// watermark's count for a job without a replicated snapshot of this host's): its creation, or, if earlier,
// its restore here. A restored job carries the creation time of the host that started it, by that host's
// clock: one far ahead of this one made the watermark this host's present, and senders freed what a
// second restore from the same snapshot needs.
func (j *Job) startedHere() time.Time {
	if !j.RestoredAt.IsZero() && j.RestoredAt.Before(j.Created) {
		return j.RestoredAt
	}
	return j.Created
}

// Replica records a snapshot of a job that a protector verified and holds.
type Replica struct {
	Snapshot string    `json:"snapshot"`
	Time     time.Time `json:"time"`    // when the protector had it
	Node     string    `json:"node"`    // the host the job ran on when the snapshot was taken
	Holders  []string  `json:"holders"` // the nodes holding a verified copy
	// Unrecoverable names the snapshot's connections a restore could not rebuild, each with why: a
	// failure of the host would end in a refusal naming them (`ftctl status` shows them).
	Unrecoverable []string `json:"unrecoverable,omitempty"`
}

// holdersHere lists the members that may hold copies of the snapshots node took of j, as its record knows
// them: those still to tell (Forget), its replica's holders, and the host it moved to.
func (j *Job) holdersHere(node string) []string {
	out := slices.Clone(j.Forget)
	if j.Replica != nil && j.Replica.Node == node {
		out = append(out, j.Replica.Holders...)
	}
	if j.MovedTo != "" {
		out = append(out, j.MovedTo)
	}
	slices.Sort(out)
	return slices.DeleteFunc(slices.Compact(out), func(h string) bool { return h == node })
}

// Protected reports whether a failure of the job's host could be recovered from a replica: one taken
// on the host the job runs on now (a restored job carries its old host's replica in its record until it
// is snapshotted again). A copy restored on the host its snapshot was taken on (a rollback, a manual
// restore there) carries that host's replica from before the snapshot: one of an execution that is gone,
// which protects it no more than another host's would.
func (j *Job) Protected() bool {
	if j.Replica == nil || j.Replica.Node != j.Node {
		return false
	}
	// Ids of one node grow (ckpt.Store.Begin), so only this host's own are compared.
	if from, err := ckpt.ParseID(j.Restored); err == nil && from.Node == j.Node && j.Replica.Snapshot <= j.Restored {
		return false
	}
	return true
}

// Covered reports whether the job is protected and its replica holds every connection the agent's last
// check found.
func (j *Job) Covered() bool { return j.Protected() && len(j.NewConns) == 0 }

// Output and status files inside a job directory. The directory's path is the same on every host (the
// restored process reopens its output files by path), so it lives under the cluster-wide jobs_dir.
//
// The directory belongs to root (0755): the job's user may read it but not add, replace or remove entries,
// so nothing in it can be a link root would follow. The shim creates stdout and stderr (O_EXCL) and hands
// them to the user; it writes exit itself.
func (j *Job) StdoutPath() string { return filepath.Join(j.Dir, stdoutName) }
func (j *Job) StderrPath() string { return filepath.Join(j.Dir, stderrName) }
func (j *Job) ExitPath() string   { return filepath.Join(j.Dir, exitName) }

const (
	stdoutName = "stdout"
	stderrName = "stderr"
	exitName   = "exit"
)

// jobLayout is where an agent keeps each job's directory and cgroup. Both are the same on every node of a
// cluster: the restored process reopens its files by path, and CRIU puts it back in its cgroup by path.
type jobLayout struct {
	jobsDir      string
	cgroupParent string
}

func (a *Agent) layout() jobLayout { return jobLayout{a.cfg.JobsDir, a.cfg.CgroupParent} }

func (l jobLayout) dir(id string) string    { return filepath.Join(l.jobsDir, id) }
func (l jobLayout) cgroup(id string) string { return filepath.Join(l.cgroupParent, id) }

// outputName returns the name of path inside job id's directory if path is one of the job's outputs
// there. inside reports whether path is in the directory at all.
func (l jobLayout) outputName(id, path string) (name string, inside bool) {
	dir := l.dir(id)
	if path != dir && !strings.HasPrefix(path, dir+"/") {
		return "", false
	}
	switch rel := strings.TrimPrefix(path, dir+"/"); rel {
	case stdoutName, stderrName:
		return rel, true
	}
	return "", true
}

var jobNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$`)

// jobIDRE is what newJobID makes: a job name, '-', 8 hex digits.
var jobIDRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}-[0-9a-f]{8}$`)

func validJobID(id string) bool { return jobIDRE.MatchString(id) }

// noID is what chown(2) takes as "leave unchanged": a record claiming it would leave root's ownership on
// the files the restore creates for the job.
const noID = ^uint32(0)

// checkPeerJob validates a snapshot's manifest and its job record, which come from another node, against
// this agent's layout before any path or id in them is used: the id names files in the state directory,
// dir is where outputs are truncated or created. Dir is not recomputed but must equal this agent's own: the
// images carry it too (CRIU reopens the files by path), so a node configured differently could not restore
// the job anyway. The cgroup becomes this agent's for the job, whichever the snapshot's node used (its
// cgroup_parent may differ): CRIU restores the job into it (criu.RestoreOptions.Cgroup), and it is removed
// when the job ends.
//
// The uid is compared with the credentials in the images before a restore (checkImageCreds), which refuses
// a thread of other credentials; a peer able to forge a job record can still forge the rest of the images,
// which CRIU restores as root.
func checkPeerJob(l jobLayout, m *ckpt.Manifest, j *Job) error {
	bad := func(field, got, want string) error {
		return fmt.Errorf("snapshot %s: job record field %q is %q, want %s", m.ID, field, got, want)
	}
	if !validJobID(m.Job) {
		return fmt.Errorf("snapshot %s: manifest field \"job\" is %q, want a job id (a name, '-', 8 hex digits)", m.ID, m.Job)
	}
	if j.ID != m.Job {
		return bad("id", j.ID, fmt.Sprintf("%q (the manifest's job)", m.Job))
	}
	if want := l.dir(j.ID); j.Dir != want {
		return bad("dir", j.Dir, fmt.Sprintf("%q", want))
	}
	j.Cgroup = l.cgroup(j.ID)
	if j.UID == noID {
		return bad("uid", fmt.Sprint(j.UID), "a user id (not 4294967295, which chown takes as \"unchanged\")")
	}
	if j.GID == noID {
		return bad("gid", fmt.Sprint(j.GID), "a group id (not 4294967295, which chown takes as \"unchanged\")")
	}
	for i, f := range m.OpenFiles {
		field := fmt.Sprintf("open_files[%d].path", i)
		if !filepath.IsAbs(f.Path) || filepath.Clean(f.Path) != f.Path {
			return fmt.Errorf("snapshot %s: manifest field %q is %q, want an absolute, clean path", m.ID, field, f.Path)
		}
		if name, inside := l.outputName(j.ID, f.Path); inside && name == "" {
			return fmt.Errorf("snapshot %s: manifest field %q is %q, inside the job directory but not %s or %s, the job's only files there",
				m.ID, field, f.Path, stdoutName, stderrName)
		}
	}
	return nil
}

// newJobID makes a cluster-unique id from a readable name and random bits.
func newJobID(name string) (string, error) {
	if !jobNameRE.MatchString(name) {
		return "", fmt.Errorf("job name %q: use up to 48 letters, digits, '.', '_' or '-', starting with a letter or digit", name)
	}
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return name + "-" + hex.EncodeToString(b[:]), nil
}

// defaultJobName is the program's base name made into a valid job name.
func defaultJobName(argv []string) string {
	if len(argv) == 0 {
		return "job"
	}
	n := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.' {
			return r
		}
		return '_'
	}, filepath.Base(argv[0]))
	if n == "" || !jobNameRE.MatchString(n) {
		return "job"
	}
	return n
}

// jobStore keeps job records as one JSON file each.
type jobStore struct{ dir string }

func (s jobStore) path(id string) string { return filepath.Join(s.dir, id+".json") }

func (s jobStore) save(j *Job) error { return atomicfile.WriteJSON(s.path(j.ID), j) }

func (s jobStore) load(id string) (*Job, error) {
	// The directory is jobs_dir in the default layout, which users may be let write to (sticky): only a
	// file of root's, not a link, is a record root wrote.
	fd, err := unix.Open(s.path(id), unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open job record %s without following a link: %w", s.path(id), err)
	}
	f := os.NewFile(uintptr(fd), s.path(id))
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("job record %s: %w", s.path(id), err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || !rootpath.Trusted(st.Uid) {
		return nil, fmt.Errorf("job record %s is not a file of root's (uid %d, mode %#o), so not one this agent wrote: skipped; remove it", s.path(id), st.Uid, st.Mode)
	}
	b, err := io.ReadAll(f)
	if err != nil {
		return nil, err
	}
	var j Job
	if err := json.Unmarshal(b, &j); err != nil {
		return nil, fmt.Errorf("job record %s is corrupt: %w", s.path(id), err)
	}
	return &j, nil
}

// all loads every record, oldest first. A corrupt record is reported, not silently dropped.
func (s jobStore) all() ([]*Job, error) {
	entries, err := os.ReadDir(s.dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var jobs []*Job
	var errs []error
	for _, e := range entries {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		j, err := s.load(id)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		jobs = append(jobs, j)
	}
	sort.Slice(jobs, func(a, b int) bool { return jobs[a].Created.Before(jobs[b].Created) })
	return jobs, errors.Join(errs...)
}
