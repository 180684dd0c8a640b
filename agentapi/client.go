package agentapi

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"syscall"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/coordinated"
	"github.com/ftkit/ftkit/ring"
)

// DefaultSocket is where ftctl and ftwrap look for the local agent unless FTKIT_AGENT_SOCKET or a flag
// says otherwise (the lab sets FTKIT_AGENT_SOCKET for each host).
const DefaultSocket = "/run/ftkit/agent.sock"

// clientIdleTimeout is how long a client keeps an idle connection to its agent.
const clientIdleTimeout = 20 * time.Second

// Client talks to an agent's local API.
type Client struct {
	socket string
	http   *http.Client
}

// NewClient returns a client for the agent listening on socket.
func NewClient(socket string) *Client {
	return &Client{socket: socket, http: &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socket)
		},
		// Shorter than the agent's idle timeout: the client, not the agent, closes an idle connection, so a
		// request (a POST is not retried) never goes out on one the agent is closing.
		IdleConnTimeout: clientIdleTimeout,
	}}}
}

// ErrAgentUnavailable means nothing answers on the socket.
var ErrAgentUnavailable = errors.New("agent not reachable")

// Socket is the path of the agent's socket this client talks to.
func (c *Client) Socket() string { return c.socket }

// send sends a request and returns the answer if it is a success; otherwise the agent's error.
func (c *Client) send(ctx context.Context, method, path string, in any) (*http.Response, error) {
	var body bytes.Buffer
	if in != nil {
		if err := json.NewEncoder(&body).Encode(in); err != nil {
			return nil, err
		}
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://agent"+path, &body)
	if err != nil {
		return nil, err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		// Named by the socket, not by the URL (whose host is a placeholder).
		if oe, ok := errors.AsType[*net.OpError](err); ok && oe.Op == "dial" {
			return nil, fmt.Errorf("%w at %s: %v (is ftagent running? start it, or point --socket or FTKIT_AGENT_SOCKET at its socket)",
				ErrAgentUnavailable, c.socket, oe.Err)
		}
		if ue, ok := errors.AsType[*url.Error](err); ok {
			return nil, fmt.Errorf("agent at %s: %s %s: %w", c.socket, method, path, ue.Err)
		}
		return nil, err
	}
	if resp.StatusCode/100 != 2 {
		defer resp.Body.Close()
		var e apiError
		if json.NewDecoder(io.LimitReader(resp.Body, maxBody)).Decode(&e) != nil || e.Error == "" {
			e.Error = resp.Status
		}
		if resp.StatusCode == http.StatusNotFound {
			return nil, fmt.Errorf("%w: %s", agent.ErrNoJob, e.Error)
		}
		return nil, errors.New(e.Error)
	}
	return resp, nil
}

// Bounds of the agent's successful answers, read into the client's memory: each is well above the largest
// honest answer of its kind, so that a wrong or hostile socket cannot have ftctl or ftwrap read without end.
const (
	// maxRecordReply bounds one job's record (or a migration's, a view's): its spec is at most
	// clusterapi.MaxStartJobBytes of arguments and environment (up to six times that as JSON), and its replica
	// names the connections no restore could rebuild, at most as many as a manifest (ckpt.MaxManifestBytes).
	maxRecordReply = 64 << 20
	// maxListReply bounds the lists: a host's jobs (each user's running and up to 1024 ended, each with its
	// spec), its snapshots' manifests (up to ckpt.MaxManifestBytes each), a checkpoint's or a cut's, the
	// failure log (about 11 MB at its bounds, 70 MB if every byte of its texts is escaped).
	maxListReply = 256 << 20
)

// do sends a request and decodes the agent's successful answer into out, reading at most limit bytes.
func (c *Client) do(ctx context.Context, method, path string, in, out any, limit int64) error {
	resp, err := c.send(ctx, method, path, in)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		return nil
	}
	body := &io.LimitedReader{R: resp.Body, N: limit + 1}
	err = json.NewDecoder(body).Decode(out)
	if err != nil && body.N <= 0 {
		return fmt.Errorf("agent at %s: %s %s: the answer is larger than %d MiB, more than any agent sends: is the socket an ftkit agent's?",
			c.socket, method, path, limit>>20)
	}
	return err
}

// Output copies the job's standard output (stream "stdout") or error ("stderr") to w. With follow it goes
// on until the job stops running on the agent's host, or ctx ends; if it stopped there because the job
// goes on elsewhere (migrated away, or this host's copy fenced and the job restored on another host), the
// error says so, and where if the agent knows: the output is not all there yet.
func (c *Client) Output(ctx context.Context, id, stream string, follow bool, w io.Writer) error {
	q := url.Values{"stream": {stream}}
	if follow {
		q.Set("follow", "true")
	}
	resp, err := c.send(ctx, http.MethodGet, "/v1/jobs/"+url.PathEscape(id)+"/output?"+q.Encode(), nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(w, resp.Body); err != nil {
		return fmt.Errorf("read the output of job %s from the agent at %s: %w", id, c.socket, err)
	}
	if !follow {
		return nil
	}
	// The agent ends a followed output when its own record of the job stops running, which a move or a
	// fence does too; ended without a word, the follow looked like the job's end.
	j, err := c.Job(ctx, id)
	switch {
	case errors.Is(err, agent.ErrNoJob):
		return nil // forgotten since (it ended long ago): nothing to add
	case err != nil:
		// The agent stopping ends a follow too (its handlers' context), cleanly: the job, which outlives it,
		// may run on.
		return fmt.Errorf("job %s: the agent at %s ended the follow of its output and cannot say whether the job ended: %w; follow it again once the agent answers",
			id, c.socket, err)
	case j.State == agent.JobRunning:
		return fmt.Errorf("job %s still runs, but the agent at %s ended the follow of its output (it is stopping or restarting): follow it again",
			id, c.socket)
	case j.State == agent.JobMoved:
		return fmt.Errorf("job %s moved to %s while its output was followed: it runs on there, writing on to the same files; follow it there (ftctl logs --follow %s on %s)",
			id, j.MovedTo, id, j.MovedTo)
	case j.State == agent.JobLost && j.Fenced:
		return fmt.Errorf("job %s: the copy on %s was stopped while its output was followed (the host was cut off or declared failed) and the job is restored on another host: follow it there (ftctl events names it)",
			id, j.Node)
	}
	return nil
}

// Status returns the agent's view of its host and jobs.
func (c *Client) Status(ctx context.Context) (agent.Status, error) {
	var s agent.Status
	return s, c.do(ctx, http.MethodGet, "/v1/status", nil, &s, maxListReply)
}

// StartJob asks the agent to start and protect a program.
func (c *Client) StartJob(ctx context.Context, spec agent.JobSpec) (agent.Job, error) {
	var j agent.Job
	return j, c.do(ctx, http.MethodPost, "/v1/jobs", spec, &j, maxRecordReply)
}

// StartJobOn asks the agent to start a program on member host, through host's agent, as the caller. The
// job record is host's: follow the job through its (cluster-wide) Dir.
func (c *Client) StartJobOn(ctx context.Context, host string, spec agent.JobSpec) (agent.Job, error) {
	var j agent.Job
	return j, c.do(ctx, http.MethodPost, "/v1/jobs?host="+url.QueryEscape(host), spec, &j, maxRecordReply)
}

// Jobs lists the jobs the caller may see.
func (c *Client) Jobs(ctx context.Context) ([]agent.Job, error) {
	var js []agent.Job
	return js, c.do(ctx, http.MethodGet, "/v1/jobs", nil, &js, maxListReply)
}

// Job returns one job.
func (c *Client) Job(ctx context.Context, id string) (agent.Job, error) {
	var j agent.Job
	return j, c.do(ctx, http.MethodGet, "/v1/jobs/"+url.PathEscape(id), nil, &j, maxRecordReply)
}

// Wait returns when the job stops running, or after timeout with its current state.
func (c *Client) Wait(ctx context.Context, id string, timeout time.Duration) (agent.Job, error) {
	var j agent.Job
	return j, c.do(ctx, http.MethodGet, "/v1/jobs/"+url.PathEscape(id)+"/wait?timeout="+timeout.String(), nil, &j, maxRecordReply)
}

// Signal sends a signal to the job's root process.
func (c *Client) Signal(ctx context.Context, id string, sig syscall.Signal) error {
	return c.do(ctx, http.MethodPost, "/v1/jobs/"+url.PathEscape(id)+"/signal", map[string]int{"signal": int(sig)}, nil, maxRecordReply)
}

// Checkpoint snapshots jobs now (all of the host's if none are named).
func (c *Client) Checkpoint(ctx context.Context, jobs ...string) (CheckpointReply, error) {
	var r CheckpointReply
	return r, c.do(ctx, http.MethodPost, "/v1/checkpoint", CheckpointRequest{Jobs: jobs}, &r, maxListReply)
}

// Snapshots lists the snapshots this host holds (its own and the replicas it keeps), newest first.
func (c *Client) Snapshots(ctx context.Context, job string) ([]*ckpt.Manifest, error) {
	var ms []*ckpt.Manifest
	return ms, c.do(ctx, http.MethodGet, "/v1/snapshots?job="+url.QueryEscape(job), nil, &ms, maxListReply)
}

// Restore restores a job on this agent's host from a snapshot.
func (c *Client) Restore(ctx context.Context, req agent.RestoreRequest) (agent.Job, error) {
	var j agent.Job
	return j, c.do(ctx, http.MethodPost, "/v1/restore", req, &j, maxRecordReply)
}

// Migrate moves a job of the host to another node of the ring (root only).
func (c *Client) Migrate(ctx context.Context, req agent.MigrateRequest) (agent.Migration, error) {
	var m agent.Migration
	return m, c.do(ctx, http.MethodPost, "/v1/migrate", req, &m, maxRecordReply)
}

// Cut takes a coordinated snapshot of a run, coordinated by this agent (root only).
func (c *Client) Cut(ctx context.Context, req coordinated.RunRequest) (coordinated.Cut, error) {
	var cut coordinated.Cut
	return cut, c.do(ctx, http.MethodPost, "/v1/cut", req, &cut, maxListReply)
}

// Rollback rolls a run back to its newest coordinated snapshot, coordinated by this agent (root only).
func (c *Client) Rollback(ctx context.Context, req coordinated.RunRequest) (coordinated.Rollback, error) {
	var r coordinated.Rollback
	return r, c.do(ctx, http.MethodPost, "/v1/rollback", req, &r, maxListReply)
}

// Drain moves every job off the host (root only).
func (c *Client) Drain(ctx context.Context, req agent.DrainRequest) (agent.DrainResult, error) {
	var r agent.DrainResult
	return r, c.do(ctx, http.MethodPost, "/v1/drain", req, &r, maxListReply)
}

// LoggedConns lists the connections in the host's sender-side log (root only).
func (c *Client) LoggedConns(ctx context.Context) ([]agent.LoggedConn, error) {
	var cs []agent.LoggedConn
	return cs, c.do(ctx, http.MethodGet, "/v1/log/conns", nil, &cs, maxListReply)
}

// Events returns the failure timelines the agent knows of, oldest first.
func (c *Client) Events(ctx context.Context) ([]*agent.Failure, error) {
	var out []*agent.Failure
	return out, c.do(ctx, http.MethodGet, "/v1/events", nil, &out, maxListReply)
}

// AddSpare registers a spare host with the cluster through this agent and returns the new view.
func (c *Client) AddSpare(ctx context.Context, req agent.SpareRequest) (ring.View, error) {
	var v ring.View
	return v, c.do(ctx, http.MethodPost, "/v1/spares", req, &v, maxRecordReply)
}
