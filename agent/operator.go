package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
)

// operatorService is the agent as the server of operators: a cluster-wide ftctl that presents an operator
// certificate of the cluster CA (clusterapi's operator operations). An operator acts as root here: each
// operation calls what the local API calls for root. The server has validated every name in the request
// and logged the audit line.
type operatorService struct{ a *Agent }

var _ clusterapi.OperatorService = operatorService{}

// notFound turns the agent's "no such job or snapshot" into the refusal ftctl reports as not found.
func notFound(err error) error {
	if errors.Is(err, ErrNoJob) || errors.Is(err, ckpt.ErrNotFound) {
		return &clusterapi.Error{Code: clusterapi.CodeNotFound, Message: err.Error()}
	}
	return err
}

func (s operatorService) Status(context.Context, string) (clusterapi.OperatorStatusReply, error) {
	b, err := json.Marshal(s.a.Status(0))
	return clusterapi.OperatorStatusReply{Status: b}, err
}

func (s operatorService) Snapshots(_ context.Context, _ string, req clusterapi.OperatorSnapshotsRequest) (clusterapi.OperatorSnapshotsReply, error) {
	ms, err := s.a.Snapshots(req.Job, 0)
	return clusterapi.OperatorSnapshotsReply{Snapshots: ms}, err
}

func (s operatorService) Events(context.Context, string) (clusterapi.OperatorEventsReply, error) {
	b, err := json.Marshal(s.a.Events(0))
	return clusterapi.OperatorEventsReply{Failures: b}, err
}

func (s operatorService) Checkpoint(ctx context.Context, _ string, req clusterapi.OperatorCheckpointRequest) (clusterapi.OperatorCheckpointReply, error) {
	// As the local API: a job this host does not know is refused before any dump.
	for _, id := range req.Jobs {
		if _, _, err := s.a.Job(id, 0); err != nil {
			return clusterapi.OperatorCheckpointReply{}, notFound(fmt.Errorf("job %s on %s: %w", id, s.a.cfg.Name, err))
		}
	}
	res, err := s.a.Checkpoint(ctx, req.Jobs, 0)
	if err != nil && (len(res) == 0 || errors.Is(err, ErrNoJob)) {
		return clusterapi.OperatorCheckpointReply{}, notFound(err)
	}
	b, merr := json.Marshal(res)
	if merr != nil {
		return clusterapi.OperatorCheckpointReply{}, merr
	}
	rep := clusterapi.OperatorCheckpointReply{Results: b}
	if err != nil {
		rep.Error = err.Error() // some jobs' snapshots failed: the others are in Results
	}
	return rep, nil
}

func (s operatorService) Restore(ctx context.Context, _ string, req clusterapi.OperatorRestoreRequest) (clusterapi.OperatorRestoreReply, error) {
	j, err := s.a.Restore(ctx, RestoreRequest{Snapshot: req.Snapshot, Job: req.Job, Source: req.Source, Force: req.Force}, 0)
	if err != nil {
		return clusterapi.OperatorRestoreReply{}, notFound(err)
	}
	b, err := json.Marshal(j)
	return clusterapi.OperatorRestoreReply{Job: b}, err
}

func (s operatorService) Migrate(ctx context.Context, _ string, req clusterapi.OperatorMigrateRequest) (clusterapi.OperatorMigrateReply, error) {
	m, err := s.a.Migrate(ctx, MigrateRequest{Job: req.Job, To: req.To}, 0)
	if err != nil {
		return clusterapi.OperatorMigrateReply{}, notFound(err)
	}
	b, err := json.Marshal(m)
	return clusterapi.OperatorMigrateReply{Migration: b}, err
}

func (s operatorService) Drain(ctx context.Context, _ string, req clusterapi.OperatorDrainRequest) (clusterapi.OperatorDrainReply, error) {
	r, err := s.a.Drain(ctx, DrainRequest{To: req.To}, 0)
	if err != nil {
		return clusterapi.OperatorDrainReply{}, err
	}
	b, err := json.Marshal(r)
	return clusterapi.OperatorDrainReply{Result: b}, err
}
