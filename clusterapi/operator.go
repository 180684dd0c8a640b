package clusterapi

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/clustertls"
)

// The operator side of the protocol: a cluster-wide ftctl, authenticated by an operator certificate (CN
// "operator:NAME", clustertls.IssueOperator), calls these operations on any agent. An operator acts as
// root on every agent that admits it; members never need these operations, so a member certificate is
// refused for them (a stolen agent key does not become an admin console), and an operator certificate is
// refused for every member operation (an operator cannot pose as a member: heartbeats, claims, recoveries,
// snapshot shipping, log ranges, views).
//
// Each operation is audited: the server logs the operator's name, the operation and its target before it
// calls the service.

// The operator operations; their paths are "/v1/operator/...", apart from the members'.
const (
	OpOperatorStatus     Op = "operator/status"     // the agent's host: jobs, the membership view, health
	OpOperatorSnapshots  Op = "operator/snapshots"  // the snapshots the agent holds (its own and replicas)
	OpOperatorEvents     Op = "operator/events"     // the failure log (replicated: every agent holds it)
	OpOperatorCheckpoint Op = "operator/checkpoint" // snapshot a job or every job of the host now
	OpOperatorRestore    Op = "operator/restore"    // restore a job on the host from a snapshot (manual fail-over)
	OpOperatorMigrate    Op = "operator/migrate"    // move a job of the host to another node (planned migration)
	OpOperatorDrain      Op = "operator/drain"      // move every job off the host
)

// OperatorOps lists the operator operations.
func OperatorOps() []Op {
	return []Op{OpOperatorStatus, OpOperatorSnapshots, OpOperatorEvents, OpOperatorCheckpoint, OpOperatorRestore, OpOperatorMigrate, OpOperatorDrain}
}

// CodeNotFound refuses an operator request naming a job or snapshot the agent does not know.
const CodeNotFound = "not-found"

// MaxOperatorReply bounds an operator reply: a host's status or snapshot list grows with its jobs and
// their manifests, well past a member message.
const MaxOperatorReply = 64 << 20

// MaxOperatorJobs bounds the jobs one checkpoint request names.
const MaxOperatorJobs = 1024

// The agent's own records (its Status, jobs, failure timelines, snapshot results) travel as the JSON the
// agent writes, as the failure timelines of OpView do: this package does not import the agent.

// OperatorStatusReply carries the agent's status record as root sees it (agent.Status).
type OperatorStatusReply struct {
	Status json.RawMessage `json:"status"`
}

// OperatorSnapshotsRequest asks for the snapshots of one job ("": every job).
type OperatorSnapshotsRequest struct {
	Job string `json:"job,omitempty"`
}

// Validate checks the job name.
func (r OperatorSnapshotsRequest) Validate() error {
	if r.Job == "" {
		return nil
	}
	return ckpt.ValidName(r.Job)
}

func (r OperatorSnapshotsRequest) target() string {
	if r.Job == "" {
		return "every job"
	}
	return "job " + r.Job
}

// OperatorSnapshotsReply lists the snapshots, newest first.
type OperatorSnapshotsReply struct {
	Snapshots []*ckpt.Manifest `json:"snapshots"`
}

// OperatorEventsReply carries the failure timelines (the agent's []*Failure).
type OperatorEventsReply struct {
	Failures json.RawMessage `json:"failures"`
}

// OperatorCheckpointRequest asks for snapshots of the named running jobs now (none: every running job).
type OperatorCheckpointRequest struct {
	Jobs []string `json:"jobs,omitempty"`
}

// Validate bounds the request and checks the job names.
func (r OperatorCheckpointRequest) Validate() error {
	if len(r.Jobs) > MaxOperatorJobs {
		return fmt.Errorf("checkpoint of %d jobs: at most %d in one request", len(r.Jobs), MaxOperatorJobs)
	}
	for _, j := range r.Jobs {
		if err := ckpt.ValidName(j); err != nil {
			return fmt.Errorf("job: %w", err)
		}
	}
	return nil
}

func (r OperatorCheckpointRequest) target() string {
	if len(r.Jobs) == 0 {
		return "every running job"
	}
	return "jobs " + strings.Join(r.Jobs, ",")
}

// OperatorCheckpointReply carries the snapshots taken (the agent's []SnapshotResult) and the jobs that
// failed, if any.
type OperatorCheckpointReply struct {
	Results json.RawMessage `json:"results"`
	Error   string          `json:"error,omitempty"`
}

// OperatorRestoreRequest asks the agent to restore a job on its host, as `ftctl restore` does locally.
type OperatorRestoreRequest struct {
	Snapshot string `json:"snapshot"`
	Job      string `json:"job,omitempty"`    // found from the snapshot if empty
	Source   string `json:"source,omitempty"` // member to fetch the snapshot from
	Force    bool   `json:"force,omitempty"`  // even if the job's node answers and runs it
}

// Validate checks every name before the agent uses it.
func (r OperatorRestoreRequest) Validate() error {
	if _, err := ckpt.ParseID(r.Snapshot); err != nil {
		return fmt.Errorf("snapshot: %w", err)
	}
	if r.Job != "" {
		if err := ckpt.ValidName(r.Job); err != nil {
			return fmt.Errorf("job: %w", err)
		}
	}
	if r.Source != "" {
		if err := clustertls.ValidateMemberName(r.Source); err != nil {
			return fmt.Errorf("source: %w", err)
		}
	}
	return nil
}

func (r OperatorRestoreRequest) target() string {
	t := "snapshot " + r.Snapshot
	if r.Job != "" {
		t += " job " + r.Job
	}
	if r.Source != "" {
		// The agent fetches the snapshot from this member: the audit says which copy was restored.
		t += " from " + r.Source
	}
	if r.Force {
		t += " (forced)"
	}
	return t
}

// OperatorRestoreReply carries the restored job (the agent's Job).
type OperatorRestoreReply struct {
	Job json.RawMessage `json:"job"`
}

// OperatorMigrateRequest asks the agent to move one of its jobs to another node of the ring.
type OperatorMigrateRequest struct {
	Job string `json:"job"`
	To  string `json:"to"`
}

// Validate checks every name before the agent uses it.
func (r OperatorMigrateRequest) Validate() error {
	if err := ckpt.ValidName(r.Job); err != nil {
		return fmt.Errorf("job: %w", err)
	}
	if err := clustertls.ValidateMemberName(r.To); err != nil {
		return fmt.Errorf("to: %w", err)
	}
	return nil
}

func (r OperatorMigrateRequest) target() string { return "job " + r.Job + " to " + r.To }

// OperatorMigrateReply carries the migration's outcome (the agent's Migration).
type OperatorMigrateReply struct {
	Migration json.RawMessage `json:"migration"`
}

// OperatorDrainRequest asks the agent to move every job off its host: to the nodes in To, in turn (none:
// the ring's other alive nodes).
type OperatorDrainRequest struct {
	To []string `json:"to,omitempty"`
}

// Validate bounds the list and checks every name.
func (r OperatorDrainRequest) Validate() error {
	if len(r.To) > MaxOperatorJobs {
		return fmt.Errorf("drain to %d hosts: at most %d in one request", len(r.To), MaxOperatorJobs)
	}
	for _, h := range r.To {
		if err := clustertls.ValidateMemberName(h); err != nil {
			return fmt.Errorf("to: %w", err)
		}
	}
	return nil
}

func (r OperatorDrainRequest) target() string {
	if len(r.To) == 0 {
		return "every job, to the ring"
	}
	return "every job, to " + strings.Join(r.To, ",")
}

// OperatorDrainReply carries the drain's outcome (the agent's DrainResult).
type OperatorDrainReply struct {
	Result json.RawMessage `json:"result"`
}

// OperatorService is what a server does for operators: one method per operation, given the operator's
// name (from its certificate) and its validated request. ctx ends when the operator goes away (or the
// server stops): a checkpoint or restore nobody waits for stops, as with the local API. Errors are sent
// back as refusals, as for Service.
type OperatorService interface {
	Status(ctx context.Context, operator string) (OperatorStatusReply, error)
	Snapshots(ctx context.Context, operator string, req OperatorSnapshotsRequest) (OperatorSnapshotsReply, error)
	Events(ctx context.Context, operator string) (OperatorEventsReply, error)
	Checkpoint(ctx context.Context, operator string, req OperatorCheckpointRequest) (OperatorCheckpointReply, error)
	Restore(ctx context.Context, operator string, req OperatorRestoreRequest) (OperatorRestoreReply, error)
	Migrate(ctx context.Context, operator string, req OperatorMigrateRequest) (OperatorMigrateReply, error)
	Drain(ctx context.Context, operator string, req OperatorDrainRequest) (OperatorDrainReply, error)
}

// validator is a request that checks itself; audited is one that names its target for the audit log.
type (
	validator interface{ Validate() error }
	audited   interface{ target() string }
)

type noRequest struct{}

func (noRequest) target() string { return "host" }

// operatorRoutes registers the operator operations (served from s.ops to operators) and, in the members'
// mux, their refusal: a member certificate is no operator's.
func (s *Server) operatorRoutes(svc OperatorService) {
	s.ops = http.NewServeMux()
	for _, op := range OperatorOps() {
		s.mux.HandleFunc(op.Path(), func(w http.ResponseWriter, r *http.Request) {
			peer, _ := clustertls.PeerName(r.TLS)
			s.refuse(w, op, peer, &Error{Code: CodeUnauthenticated,
				Message: "a member certificate may not call operator operations: use an operator certificate (ftctl pki issue --operator)"})
		})
	}
	if svc != nil {
		handleOperator(s, OpOperatorStatus, 0, func(ctx context.Context, op string, _ noRequest) (OperatorStatusReply, error) {
			return svc.Status(ctx, op)
		})
		handleOperator(s, OpOperatorSnapshots, MaxHeader, svc.Snapshots)
		handleOperator(s, OpOperatorEvents, 0, func(ctx context.Context, op string, _ noRequest) (OperatorEventsReply, error) {
			return svc.Events(ctx, op)
		})
		handleOperator(s, OpOperatorCheckpoint, MaxMessage, svc.Checkpoint)
		handleOperator(s, OpOperatorRestore, MaxHeader, svc.Restore)
		handleOperator(s, OpOperatorMigrate, MaxHeader, svc.Migrate)
		handleOperator(s, OpOperatorDrain, MaxMessage, svc.Drain)
	}
	s.ops.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		op := Op(strings.TrimPrefix(r.URL.Path, "/v1/"))
		who := operatorPeer(r)
		switch {
		case slices.Contains(Ops(), op):
			s.refuse(w, op, who, &Error{Code: CodeUnauthenticated, Message: "an operator certificate may not call member operations"})
		case svc == nil && slices.Contains(OperatorOps(), op):
			s.refuse(w, op, who, &Error{Code: CodeUnauthenticated, Message: "this agent serves no operators"})
		default:
			s.refuse(w, op, who, &Error{Code: CodeUnknownOp, Message: "no such operation: " + r.URL.Path})
		}
	})
}

// operatorPeer names an operator in the logs as its certificate does.
func operatorPeer(r *http.Request) string {
	name, _ := clustertls.OperatorName(r.TLS)
	return clustertls.OperatorPrefix + name
}

// serveOperator serves a request of an authenticated operator.
func (s *Server) serveOperator(w http.ResponseWriter, r *http.Request, op Op) {
	if r.Method != http.MethodPost {
		s.refuse(w, op, operatorPeer(r), &Error{Code: CodeMethod, Message: "operations are POST requests, not " + r.Method})
		return
	}
	s.ops.ServeHTTP(w, r)
}

// handleOperator routes an operator operation: the body (at most limit bytes, none if 0) decoded and
// validated into Req, an audit line, then fn's reply.
func handleOperator[Req audited, Rep any](s *Server, op Op, limit int, fn func(context.Context, string, Req) (Rep, error)) {
	s.ops.HandleFunc(op.Path(), func(w http.ResponseWriter, r *http.Request) {
		name, _ := clustertls.OperatorName(r.TLS) // ServeHTTP checked it
		who := clustertls.OperatorPrefix + name
		var req Req
		if err := s.readRequest(w, r, op, limit, &req); err != nil {
			s.refuse(w, op, who, err)
			return
		}
		if v, ok := any(req).(validator); ok {
			if err := v.Validate(); err != nil {
				s.refuse(w, op, who, &Error{Code: CodeBadRequest, Message: err.Error()})
				return
			}
		}
		s.log.Info("operator request", "operator", name, "op", op, "target", req.target(), "remote", r.RemoteAddr)
		rep, err := fn(r.Context(), name, req)
		if err != nil {
			s.refuse(w, op, who, err)
			return
		}
		s.reply(w, r, op, who, rep)
	})
}

// operatorCall is call with the operator reply bound.
func operatorCall[Rep any](c *Client, ctx context.Context, peer string, op Op, req any) (Rep, error) {
	var rep Rep
	resp, err := c.postJSON(ctx, peer, op, req)
	if err != nil {
		return rep, err
	}
	defer resp.Body.Close()
	dec := json.NewDecoder(io.LimitReader(resp.Body, MaxOperatorReply))
	if err := dec.Decode(&rep); err != nil {
		return rep, fmt.Errorf("%s reply from %s (at most %d bytes) is not the expected JSON: %w", op, peer, MaxOperatorReply, err)
	}
	return rep, nil
}

// OperatorStatus asks peer for its status.
func (c *Client) OperatorStatus(ctx context.Context, peer string) (OperatorStatusReply, error) {
	ctx, cancel := within(ctx, c.cfg.Timeouts.LargeTimeout(MaxOperatorReply))
	defer cancel()
	return operatorCall[OperatorStatusReply](c, ctx, peer, OpOperatorStatus, nil)
}

// OperatorSnapshots asks peer for the snapshots it holds.
func (c *Client) OperatorSnapshots(ctx context.Context, peer string, req OperatorSnapshotsRequest) (OperatorSnapshotsReply, error) {
	ctx, cancel := within(ctx, c.cfg.Timeouts.LargeTimeout(MaxOperatorReply))
	defer cancel()
	return operatorCall[OperatorSnapshotsReply](c, ctx, peer, OpOperatorSnapshots, req)
}

// OperatorEvents asks peer for the failure log.
func (c *Client) OperatorEvents(ctx context.Context, peer string) (OperatorEventsReply, error) {
	ctx, cancel := within(ctx, c.cfg.Timeouts.LargeTimeout(MaxOperatorReply))
	defer cancel()
	return operatorCall[OperatorEventsReply](c, ctx, peer, OpOperatorEvents, nil)
}

// OperatorCheckpoint asks peer to snapshot jobs now. It takes as long as the dumps and shipping take:
// ctx bounds it.
func (c *Client) OperatorCheckpoint(ctx context.Context, peer string, req OperatorCheckpointRequest) (OperatorCheckpointReply, error) {
	if err := req.Validate(); err != nil {
		return OperatorCheckpointReply{}, err
	}
	return operatorCall[OperatorCheckpointReply](c, ctx, peer, OpOperatorCheckpoint, req)
}

// OperatorRestore asks peer to restore a job on its host. It takes as long as the fetch and restore
// take: ctx bounds it.
func (c *Client) OperatorRestore(ctx context.Context, peer string, req OperatorRestoreRequest) (OperatorRestoreReply, error) {
	if err := req.Validate(); err != nil {
		return OperatorRestoreReply{}, err
	}
	return operatorCall[OperatorRestoreReply](c, ctx, peer, OpOperatorRestore, req)
}

// OperatorMigrate asks peer to move one of its jobs to another node. It takes as long as the dump, the
// transfer and the restore take: ctx bounds it.
func (c *Client) OperatorMigrate(ctx context.Context, peer string, req OperatorMigrateRequest) (OperatorMigrateReply, error) {
	if err := req.Validate(); err != nil {
		return OperatorMigrateReply{}, err
	}
	return operatorCall[OperatorMigrateReply](c, ctx, peer, OpOperatorMigrate, req)
}

// OperatorDrain asks peer to move every job off its host. It takes as long as the migrations take: ctx
// bounds it.
func (c *Client) OperatorDrain(ctx context.Context, peer string, req OperatorDrainRequest) (OperatorDrainReply, error) {
	if err := req.Validate(); err != nil {
		return OperatorDrainReply{}, err
	}
	return operatorCall[OperatorDrainReply](c, ctx, peer, OpOperatorDrain, req)
}
