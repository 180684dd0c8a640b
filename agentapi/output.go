package agentapi

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/internal/jobfs"
)

// followPoll is how often a followed output is read again: a file's growth wakes nobody.
const followPoll = 250 * time.Millisecond

// serveOutput answers GET /v1/jobs/{id}/output?stream=stdout|stderr[&follow=true]: the job's output as
// its owner or root may read it. The file is in a job directory its user may have had (an older agent
// handed it over), so it is opened without following a link anywhere under the directory and must be a
// regular file of the job's user: root never reads another file on a user's behalf.
func serveOutput(a Backend, w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	stream := q.Get("stream")
	if stream == "" {
		stream = "stdout"
	}
	if stream != "stdout" && stream != "stderr" {
		writeError(w, http.StatusBadRequest, fmt.Errorf("stream %q: use stdout or stderr", stream))
		return
	}
	follow := false
	if v := q.Get("follow"); v != "" {
		var err error
		if follow, err = strconv.ParseBool(v); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Errorf("follow %q: use true or false", v))
			return
		}
	}
	id, uid := r.PathValue("id"), callerOf(r).Uid
	j, changed, err := a.Job(id, uid)
	if err != nil {
		writeError(w, http.StatusNotFound, err)
		return
	}
	f, err := openOutput(j, stream)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		writeError(w, http.StatusNotFound, fmt.Errorf("job %s has no %s on this host: %w", id, stream, err))
		return
	case err != nil:
		writeError(w, http.StatusConflict, fmt.Errorf("job %s: its %s is not read: %w", id, stream, err))
		return
	}
	defer f.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	running := j.State == agent.JobRunning
	tick := time.NewTicker(followPoll)
	defer tick.Stop()
	for {
		// Whether the job still ran is read before the copy: once it has ended, one last copy reads all
		// it wrote.
		last := !follow || !running
		if _, err := io.Copy(w, f); err != nil {
			return // the client went away
		}
		rc.Flush()
		if last {
			return
		}
		select {
		case <-changed:
			j, changed, err = a.Job(id, uid)
			running = err == nil && j.State == agent.JobRunning
		case <-tick.C:
		case <-r.Context().Done():
			return
		}
	}
}

// openOutput opens one of the job's output files for reading.
func openOutput(j agent.Job, stream string) (*os.File, error) {
	p := j.StdoutPath()
	if stream == "stderr" {
		p = j.StderrPath()
	}
	// The job directory's parent is jobs_dir, root's own: the directory itself must not be a link.
	dir, err := jobfs.OpenDir(filepath.Dir(p))
	if err != nil {
		return nil, err
	}
	defer dir.Close()
	return dir.OpenOwned(filepath.Base(p), os.O_RDONLY, j.UID)
}
