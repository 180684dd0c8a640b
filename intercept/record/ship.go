package record

import (
	"context"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/internal/tickgrid"
)

// DefaultShipEvery is log.receive_order_ship_every's default: shipping rounds fall at most once in each
// interval of its grid, right after the recorder's read there, what the recorder gave going in one batch per
// job. A batch is a write and a read on each agent (a determinant stream to the protector; it was a cluster
// request until 2026-11-28, and on 2 vCPUs a round cost about 1 ms of CPU over the two agents). Measured
// (bench receive-order, docs/receive-order.md): a round per call cost stencil2d 13.8%, rounds 2 ms apart
// 6.0-6.8%, 20 ms apart 3.0-5.2%; since the agents' wakeups were cut
// (2026-11-27), 20 ms 1.8% and 2 ms 8.8%, and on a machine with CPUs half as fast 6.1% and 15%. The price:
// a determinant reaches the protector up to this much later, which widens the window in which a crash takes
// determinants that a send already depended on (an orphan: the recovery then fails loudly). A site whose
// programs answer messages within milliseconds lowers it.
const DefaultShipEvery = 20 * time.Millisecond

// MaxShipEvery bounds log.receive_order_ship_every: beyond it nearly every crash takes determinants with it.
const MaxShipEvery = time.Second

// ship sends each job's new determinants to its protector as they come, at most one round in each
// interval of the shipping grid (tickgrid), until ctx ends.
func (r *Recorder) ship(ctx context.Context) {
	defer r.closeStreams(true)
	var retry <-chan time.Time // armed while a round left determinants behind (no protector answered)
	var last time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.wake:
		case <-retry:
		}
		if tickgrid.Slot(time.Now(), r.shipEvery) == tickgrid.Slot(last, r.shipEvery) && !r.anyHeld() {
			// A round was made in this interval already: the next at the grid's next instant, where the
			// recorder reads too (one wakeup). The recorder's read at an instant is shipped at once.
			select {
			case <-ctx.Done():
				return
			case <-time.After(tickgrid.Until(time.Now(), r.shipEvery)):
			}
		}
		last = time.Now()
		r.mu.Lock()
		var todo []*stream
		for _, s := range r.byJob {
			if len(s.pending) > 0 && s.cgroup != 0 {
				todo = append(todo, s)
			}
		}
		r.mu.Unlock()
		retry = nil
		for _, s := range todo {
			if !r.shipStream(ctx, s) {
				retry = time.After(tickgrid.Until(time.Now(), shipRetry))
			}
		}
		r.closeStreams(false)
	}
}

// send ships req to peer on the determinant stream there, opened as needed, and closes the stream when it
// breaks. A peer that serves no streams (an agent of an earlier version) gets a request.
func (r *Recorder) send(ctx context.Context, peer string, req clusterapi.DeterminantsRequest) error {
	peers := r.peers()
	if r.noStream[peer] {
		return peers.Determinants(ctx, peer, req)
	}
	st := r.streams[peer]
	if st == nil || st.Stale() {
		r.closeStream(peer)
		var err error
		if st, err = peers.DeterminantStream(ctx, peer); err != nil {
			if e := clusterapi.Refusal(err); e != nil && e.Code == clusterapi.CodeUnknownOp {
				r.log.Info("a protector serves no determinant streams (an earlier version): it gets a request per batch", "protector", peer)
				r.noStream[peer] = true
				return peers.Determinants(ctx, peer, req)
			}
			return err
		}
		r.streams[peer] = st
	}
	err := st.Send(ctx, req)
	if err != nil && clusterapi.Refusal(err) == nil {
		r.closeStream(peer)
	}
	return err
}

// closeStreams closes the determinant streams that fell silent (all of them with all): a job's protector
// changed, or its jobs stopped receiving.
func (r *Recorder) closeStreams(all bool) {
	for peer, st := range r.streams {
		if all || st.Stale() {
			r.closeStream(peer)
		}
	}
}

func (r *Recorder) closeStream(peer string) {
	if st := r.streams[peer]; st != nil {
		st.Close()
		delete(r.streams, peer)
	}
}

// shipRetry is how soon a batch no protector took is offered again, new calls or not.
const shipRetry = 100 * time.Millisecond

// shipStream sends one batch of s's pending determinants to its job's protector. It reports whether it
// left none behind for a retry (a batch refused or unanswered, more than a batch pending).
func (r *Recorder) shipStream(ctx context.Context, s *stream) bool {
	prot, ok := r.protector(s.job)
	if !ok {
		r.releaseHeld(s, true) // no protector to wait for: holding the job would stop it for good
		return false
	}
	r.mu.Lock()
	n := min(len(s.pending), intercept.MaxBatch)
	batch := intercept.Batch{Job: s.job, Stream: s.id, First: s.first, FromStart: s.fromStart && s.first == 0, Base: s.base, Dets: s.pending[:n:n]}
	readAt := s.readAt
	r.mu.Unlock()
	packed, err := intercept.Pack(batch.Dets)
	if err == nil {
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err = r.send(sctx, prot, clusterapi.DeterminantsRequest{
			Job: batch.Job, Stream: batch.Stream, First: batch.First, FromStart: batch.FromStart, Base: batch.Base, Packed: packed})
		cancel()
	}
	if err != nil {
		r.log.Debug("determinants not shipped; retrying", "job", s.job, "protector", prot, "err", err)
		return false
	}
	r.mu.Lock()
	if s.first == batch.First { // no hole was made meanwhile
		s.pending = s.pending[n:]
		s.first += uint64(n)
		// The rest keep the oldest read time: their lag is overstated, never understated.
	}
	left := len(s.pending) > 0
	r.mu.Unlock()
	if r.metrics != nil {
		r.metrics.DeterminantsShipped(n, time.Since(readAt))
	}
	r.releaseHeld(s, false)
	return !left
}
