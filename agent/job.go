package agent

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/ftkit/ftkit/internal/atomicfile"
)

// JobState is where a job is in its life.
type JobState string

const (
	JobRunning JobState = "running"
	JobExited  JobState = "exited"
	// JobLost: the job's process vanished without an exit record (killed with its shim, say).
	JobLost JobState = "lost"
)

// JobSpec is what a client asks the agent to run.
type JobSpec struct {
	Name     string   `json:"name,omitempty"`
	Argv     []string `json:"argv"`
	Env      []string `json:"env,omitempty"`
	Dir      string   `json:"dir,omitempty"`
	Interval string   `json:"interval,omitempty"` // "" (agent default), a duration, or "auto"
}

// Job is the agent's record of a protected job on this host, kept in <state_dir>/jobs/<id>.json.
type Job struct {
	ID       string      `json:"id"`
	Spec     JobSpec     `json:"spec"`
	UID      uint32      `json:"uid"`
	GID      uint32      `json:"gid"`
	Node     string      `json:"node"`
	PID      int         `json:"pid"` // host PID of the job's root (its PID-namespace init)
	State    JobState    `json:"state"`
	Exit     *ExitStatus `json:"exit,omitempty"`
	Created  time.Time   `json:"created"`
	Cgroup   string      `json:"cgroup"`
	Dir      string      `json:"dir"` // cluster-wide job directory: stdout, stderr, exit
	Restored string      `json:"restored_from,omitempty"`
	// Incarnation counts the job's restores: 0 as started, k+1 once restored from a snapshot of incarnation
	// k (a snapshot's job record carries the incarnation that took it). A majority of the members must
	// grant an incarnation before it runs, so that the job has exactly one live incarnation.
	Incarnation uint64 `json:"incarnation,omitempty"`
}

// Output and status files inside a job directory. The directory's path is the same on every host (the
// restored process reopens its output files by path), so it lives under the cluster-wide jobs_dir.
func (j *Job) StdoutPath() string { return filepath.Join(j.Dir, "stdout") }
func (j *Job) StderrPath() string { return filepath.Join(j.Dir, "stderr") }
func (j *Job) ExitPath() string   { return filepath.Join(j.Dir, "exit") }

var jobNameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$`)

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
	b, err := os.ReadFile(s.path(id))
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

// ReadExit returns the job's exit record if its shim wrote one.
func ReadExit(path string) (*ExitStatus, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var st ExitStatus
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, fmt.Errorf("exit record %s: %w", path, err)
	}
	return &st, nil
}
