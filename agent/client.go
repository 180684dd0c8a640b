package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"syscall"
	"time"

	"github.com/ftkit/ftkit/ckpt"
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

func (c *Client) do(ctx context.Context, method, path string, in, out any) error {
	var body bytes.Buffer
	if in != nil {
		if err := json.NewEncoder(&body).Encode(in); err != nil {
			return err
		}
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://agent"+path, &body)
	if err != nil {
		return err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		var oe *net.OpError
		if errors.As(err, &oe) && oe.Op == "dial" {
			return fmt.Errorf("%w at %s (is ftagent running? start it, or point FTKIT_AGENT_SOCKET at its socket): %v", ErrAgentUnavailable, c.socket, err)
		}
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		var e apiError
		if json.NewDecoder(resp.Body).Decode(&e) != nil || e.Error == "" {
			e.Error = resp.Status
		}
		if resp.StatusCode == http.StatusNotFound {
			return fmt.Errorf("%w: %s", ErrNoJob, e.Error)
		}
		return errors.New(e.Error)
	}
	if out == nil {
		return nil
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

// Status returns the agent's view of its host and jobs.
func (c *Client) Status(ctx context.Context) (Status, error) {
	var s Status
	return s, c.do(ctx, http.MethodGet, "/v1/status", nil, &s)
}

// StartJob asks the agent to start and protect a program.
func (c *Client) StartJob(ctx context.Context, spec JobSpec) (Job, error) {
	var j Job
	return j, c.do(ctx, http.MethodPost, "/v1/jobs", spec, &j)
}

// Jobs lists the jobs the caller may see.
func (c *Client) Jobs(ctx context.Context) ([]Job, error) {
	var js []Job
	return js, c.do(ctx, http.MethodGet, "/v1/jobs", nil, &js)
}

// Job returns one job.
func (c *Client) Job(ctx context.Context, id string) (Job, error) {
	var j Job
	return j, c.do(ctx, http.MethodGet, "/v1/jobs/"+url.PathEscape(id), nil, &j)
}

// Wait returns when the job stops running, or after timeout with its current state.
func (c *Client) Wait(ctx context.Context, id string, timeout time.Duration) (Job, error) {
	var j Job
	return j, c.do(ctx, http.MethodGet, "/v1/jobs/"+url.PathEscape(id)+"/wait?timeout="+timeout.String(), nil, &j)
}

// Signal sends a signal to the job's root process.
func (c *Client) Signal(ctx context.Context, id string, sig syscall.Signal) error {
	return c.do(ctx, http.MethodPost, "/v1/jobs/"+url.PathEscape(id)+"/signal", map[string]int{"signal": int(sig)}, nil)
}

// Checkpoint snapshots jobs now (all of the host's if none are named).
func (c *Client) Checkpoint(ctx context.Context, jobs ...string) (CheckpointReply, error) {
	var r CheckpointReply
	return r, c.do(ctx, http.MethodPost, "/v1/checkpoint", CheckpointRequest{Jobs: jobs}, &r)
}

// Snapshots lists the snapshots this host holds (its own and the replicas it keeps), newest first.
func (c *Client) Snapshots(ctx context.Context, job string) ([]*ckpt.Manifest, error) {
	var ms []*ckpt.Manifest
	return ms, c.do(ctx, http.MethodGet, "/v1/snapshots?job="+url.QueryEscape(job), nil, &ms)
}

// Restore restores a job on this agent's host from a snapshot.
func (c *Client) Restore(ctx context.Context, req RestoreRequest) (Job, error) {
	var j Job
	return j, c.do(ctx, http.MethodPost, "/v1/restore", req, &j)
}

// LoggedConns lists the connections in the host's sender-side log (root only).
func (c *Client) LoggedConns(ctx context.Context) ([]LoggedConn, error) {
	var cs []LoggedConn
	return cs, c.do(ctx, http.MethodGet, "/v1/log/conns", nil, &cs)
}

// Events returns the failure timelines the agent knows of, oldest first.
func (c *Client) Events(ctx context.Context) ([]*Failure, error) {
	var out []*Failure
	return out, c.do(ctx, http.MethodGet, "/v1/events", nil, &out)
}

// AddSpare registers a spare host with the cluster through this agent and returns the new view.
func (c *Client) AddSpare(ctx context.Context, req SpareRequest) (ring.View, error) {
	var v ring.View
	return v, c.do(ctx, http.MethodPost, "/v1/spares", req, &v)
}
