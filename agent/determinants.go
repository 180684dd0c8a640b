package agent

import (
	"context"
	"errors"
	"fmt"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/intercept"
)

// Receive-order determinants (package intercept): this host records the receive calls of its jobs and
// ships them to each job's protector (intercept/record, a.det); as a protector it keeps those of the jobs
// it protects (intercept.Store, a.detStore) and serves them to the target of a recovery.

// detProtector names job's protector now, for the shipping of its determinants.
func (a *Agent) detProtector(job string) (string, bool) {
	a.mu.Lock()
	j, ok := a.byID[job]
	var p *Placement
	if ok {
		p = j.Spec.Placement
	}
	a.mu.Unlock()
	prot, ok := a.protectorOf(a.View(), p)
	return prot.Name, ok
}

// serveDeterminants stores a batch a member shipped as its job's protector.
func (a *Agent) serveDeterminants(peer string, req clusterapi.DeterminantsRequest) error {
	if a.detStore == nil {
		return errors.New("this agent keeps no determinants")
	}
	b, err := req.Batch()
	if err != nil {
		return err
	}
	if !validJobID(b.Job) {
		return fmt.Errorf("determinants of job %q: not a job id an agent makes", b.Job)
	}
	if b.Base != "" {
		if _, err := ckpt.ParseID(b.Base); err != nil {
			return fmt.Errorf("determinants of job %s: base snapshot: %w", b.Job, err)
		}
	}
	a.detStore.Add(peer, b)
	return nil
}

// serveDeterminantsSince answers what a job consumed after a snapshot this host holds, a page at a time.
func (a *Agent) serveDeterminantsSince(req clusterapi.DeterminantsSinceRequest) (clusterapi.DeterminantsSinceReply, error) {
	dets, err := a.determinantsSince(req.Job, req.Snapshot, req.Ran)
	if err != nil {
		return clusterapi.DeterminantsSinceReply{}, err
	}
	if req.From > uint64(len(dets)) {
		return clusterapi.DeterminantsSinceReply{}, fmt.Errorf("determinants of job %s since %s: page from %d of %d", req.Job, req.Snapshot, req.From, len(dets))
	}
	page := dets[req.From:]
	n := intercept.Fits(page) // a page of a job reading thousands of connections names at most MaxConns
	more := n < len(page)
	page = page[:n]
	packed, err := intercept.Pack(page)
	return clusterapi.DeterminantsSinceReply{Packed: packed, More: more}, err
}

// determinantsSince is what job consumed after its snapshot id (which this host holds) when it last ran
// from it on host ran ("": the snapshot's own), from this host's store (intercept.Store.SinceOn).
func (a *Agent) determinantsSince(job, id, ran string) ([]intercept.Det, error) {
	if a.detStore == nil {
		return nil, errors.New("this agent keeps no determinants")
	}
	m, err := a.store.Manifest(job, id)
	if err != nil {
		return nil, fmt.Errorf("determinants since snapshot %s of job %s: %w", id, job, err)
	}
	return a.detStore.SinceOn(m, ran)
}

// DeterminantsSince is what job consumed after snapshot m when it last ran from m on host ran (the failed
// node: m's own, or a spare restored from m that failed before a snapshot of its own), asked of source
// (the member the snapshot came from, which protects the job), or read here.
func (a *Agent) DeterminantsSince(ctx context.Context, source string, m *ckpt.Manifest, ran string) ([]intercept.Det, error) {
	if ran == m.Node {
		// Said only when it is another host: a member of the previous version decodes requests strictly
		// and would refuse every request that names one.
		ran = ""
	}
	if source == "" || source == a.cfg.Name {
		return a.determinantsSince(m.Job, m.ID, ran)
	}
	dets, err := a.peers().DeterminantsSince(ctx, source, m.Job, m.ID, ran)
	if err != nil {
		var refused *clusterapi.Error
		if errors.As(err, &refused) {
			return nil, fmt.Errorf("%s has no complete determinants: %s", source, refused.Message)
		}
		return nil, err
	}
	return dets, nil
}
