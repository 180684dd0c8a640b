package record

import (
	"context"
	"slices"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/intercept"
	"github.com/ftkit/ftkit/internal/tickgrid"
)

// DefaultShipEvery is log.receive_order_ship_every's default: shipping rounds fall at most once in each
// interval of its grid, right after the recorder's read there, what the recorder gave going in one batch per
// job. A batch is a write on the member and a read on the protector, answered only now and then (a
// determinant stream to the protector; until 2026-12-01 every batch was answered, and until 2026-11-28 it
// was a cluster request, a round costing about 1 ms of CPU over the two agents on 2 vCPUs). Measured
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
	var again <-chan time.Time // armed while a job has determinants to send, or to see answered
	var last time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.wake:
		case <-again:
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
		var todo, free []*stream
		for _, s := range r.byJob {
			if len(s.pending) > 0 && s.cgroup != 0 {
				todo = append(todo, s)
			}
			if len(s.held) > 0 && s.held[0].upTo <= s.first {
				// Its determinant went in a hole (lost calls, an unreadable one): nothing it waits for will be
				// stored. Only an answer released a held process, and a job with nothing left to send got none:
				// it stayed stopped for good.
				free = append(free, s)
			}
		}
		r.mu.Unlock()
		for _, s := range free {
			r.releaseHeld(s, false)
		}
		var next time.Duration
		for _, s := range todo {
			if d := r.shipStream(ctx, s); d > 0 && (next == 0 || d < next) {
				next = d
			}
		}
		again = nil
		if next > 0 {
			again = time.After(tickgrid.Within(time.Now(), next, r.shipEvery)) // on the grid the recorder reads on
		}
		r.closeStreams(false)
	}
}

// streamTo is the determinant stream to peer, opened as needed; nil for a peer that serves none (an
// agent of an earlier version: it gets a request per batch).
func (r *Recorder) streamTo(ctx context.Context, peer string) (detStream, error) {
	if r.noStream[peer] {
		return nil, nil
	}
	st := r.streams[peer]
	if st != nil && !st.Stale() {
		return st, nil
	}
	r.closeStream(peer)
	st, err := r.open(ctx, peer)
	if err != nil {
		if e := clusterapi.Refusal(err); e != nil && e.Code == clusterapi.CodeUnknownOp {
			r.log.Info("a protector serves no determinant streams of this version (an earlier one): it gets a request per batch", "protector", peer)
			r.noStream[peer] = true
			return nil, nil
		}
		return nil, err
	}
	r.streams[peer] = st
	return st, nil
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

// answerEvery is how long a job's batches go unanswered on a determinant stream at most, while no held
// process waits for one: the protector then stores each as it comes, and the member learns that it may
// forget them (and of a refusal) this much later. Each answer cost the protector as much as a batch.
const answerEvery = 250 * time.Millisecond

// maxUnanswered is how many determinants a job sends at most before it asks for an answer: what it sends
// again after a broken stream.
const maxUnanswered = 4 * intercept.MaxBatch

// forgetSent drops the determinants the protector answered, moving the others to the front of the array
// that the next calls fill again. Reslicing instead made append allocate a new array after every answer:
// on a job receiving a million 64-byte messages that was a tenth of its agent's CPU, in page faults and
// zeroing (ftbench receive-order's message stream). An array left much larger than needed by a burst
// is given back.
func (s *stream) forgetSent() {
	rest := s.pending[s.sent:]
	if cap(s.pending) > 2*maxUnanswered && len(rest) < cap(s.pending)/4 {
		s.pending = slices.Clone(rest)
		return
	}
	s.pending = s.pending[:copy(s.pending, rest)]
}

// shipStream sends one batch of s's pending determinants not sent yet to its job's protector, asking for an
// answer when one is due. It returns how soon it wants to be called again, 0 when nothing is left to
// send or to see answered.
func (r *Recorder) shipStream(ctx context.Context, s *stream) time.Duration {
	prot, ok := r.protector(s.job)
	if !ok {
		r.releaseHeld(s, true) // no protector to wait for: holding the job would stop it for good
		return shipRetry
	}
	on, err := r.streamTo(ctx, prot)
	if err != nil {
		r.log.Debug("determinants not shipped; retrying", "job", s.job, "protector", prot, "err", err)
		return shipRetry
	}
	now := time.Now()
	r.mu.Lock()
	if len(s.pending) == 0 {
		r.mu.Unlock()
		return 0
	}
	if s.lostUnread {
		// Taken after a loss while calls recorded before it were still in the ring: they may hold calls from
		// both sides of the lost one, and go in a hole once those are read (holeAfterUnread).
		r.mu.Unlock()
		return shipRetry
	}
	if s.sentOn != on {
		// Sent on a stream that is gone, to this protector or another: sent again, from the oldest the
		// protector did not answer (the store keeps what it has).
		s.sent, s.sentOn, s.unsentAt = 0, on, s.readAt
	}
	n := intercept.Fits(s.pending[s.sent:]) // what one batch can name: the rest goes in the next
	ask := on == nil || len(s.held) > 0 || s.sent+n >= maxUnanswered || now.Sub(s.answeredAt) >= r.answerEvery
	if n == 0 && !ask {
		wait := r.answerEvery - now.Sub(s.answeredAt)
		r.mu.Unlock()
		return wait
	}
	first := s.first
	batch := intercept.Batch{Job: s.job, Stream: s.id, First: first + uint64(s.sent), Base: s.base, Dets: s.pending[s.sent : s.sent+n : s.sent+n]}
	batch.FromStart = s.fromStart && batch.First == 0
	unsentAt := s.unsentAt
	r.mu.Unlock()
	packed, err := intercept.Pack(batch.Dets)
	if err == nil {
		req := clusterapi.DeterminantsRequest{Job: batch.Job, Stream: batch.Stream, First: batch.First, FromStart: batch.FromStart,
			Base: batch.Base, Packed: packed, Ack: ask && on != nil}
		sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		if on == nil {
			err = r.peers().Determinants(sctx, prot, req)
		} else if err = on.Send(sctx, req); err != nil {
			r.closeStream(prot) // what it carried unanswered goes again on the next
		}
		cancel()
	}
	if err != nil {
		if refusedForGood(err) {
			r.refused(s, prot, first, err)
			return shipRetry
		}
		r.log.Debug("determinants not shipped; retrying", "job", s.job, "protector", prot, "err", err)
		return shipRetry
	}
	r.mu.Lock()
	s.refusedBy = ""
	if s.first == first { // no hole was made meanwhile
		s.sent += n
		if ask { // answered: the protector stored every batch sent before on the stream
			s.forgetSent()
			s.first += uint64(s.sent)
			s.sent, s.answeredAt, s.readAt = 0, time.Now(), s.unsentAt
		}
		// The unsent rest keep the oldest read time: their lag is overstated, never understated.
	}
	var again time.Duration
	switch {
	case len(s.pending) > s.sent:
		again = shipRetry
	case len(s.pending) > 0:
		again = max(r.answerEvery-time.Since(s.answeredAt), time.Millisecond)
	}
	r.mu.Unlock()
	if r.metrics != nil && n > 0 {
		r.metrics.DeterminantsShipped(n, time.Since(unsentAt))
	}
	if ask {
		r.releaseHeld(s, false)
	}
	return again
}

// refusedForGood reports whether err is the protector's answer that it will not store a batch (another
// version's encoding, a batch it cannot take): sent again, it is refused again.
func refusedForGood(err error) bool {
	e := clusterapi.Refusal(err)
	return e != nil && (e.Code == clusterapi.CodeRefused || e.Code == clusterapi.CodeBadRequest || e.Code == clusterapi.CodeTooLarge)
}

// refused handles a batch of s that its protector prot refused for good (refusedForGood), sent when s's
// oldest unanswered determinant had index first. Sending it again for good kept every later determinant of
// the job behind it, and a process held for one of them stopped for good, with the refusal at debug level
// only. The unanswered determinants go instead, leaving a hole (a replay from a snapshot before it is
// refused, as for lost calls), the job's held processes go on (nothing it waits for will be stored), and
// the first refusal of a run of them is an error in the log.
func (r *Recorder) refused(s *stream, prot string, first uint64, err error) {
	r.mu.Lock()
	if s.first == first { // else a hole was made meanwhile, and those determinants are gone already
		s.dropPending()
		r.hole()
	}
	again := s.refusedBy == prot
	s.refusedBy = prot
	r.mu.Unlock()
	if again {
		r.log.Debug("determinants refused by the job's protector again; dropped", "job", s.job, "protector", prot, "err", err)
	} else {
		r.log.Error("the job's protector refused its determinants for good (agents of another version refuse each batch): they are dropped, and a recovery of the job from its current snapshot replays without its receive order",
			"job", s.job, "protector", prot, "err", err)
	}
	r.releaseHeld(s, true)
}
