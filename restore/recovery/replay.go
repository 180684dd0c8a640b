package recovery

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/ftkit/ftkit/recvdigest"
	"github.com/ftkit/ftkit/tcpflow"
)

// Checking re-sent bytes. After a restore, the restored job re-emits the bytes its surviving peers already
// received since the snapshot, and the peers' TCP discards them unread. A program whose output depends on
// anything but its inputs (the clock, a random source, the order in which it reads its sockets) re-sends
// different bytes and silently diverges from what its peers saw. So every host records what its protected
// sockets receive (recvdigest), the target fetches the surviving peers' records before the restore (plan)
// and checks EVERY re-sent byte against them before the job is re-protected. At the first difference, or
// at a byte it cannot check, it kills the job: a recovery never reports success with an unchecked byte.

// ReplayAndVerify waits for a restored job's replay and checks every byte it re-sent. A job that does not
// re-send what its peers had within the replay timeout (it diverged and waits for a message nobody will
// send, or re-sent fewer bytes) or whose bytes fail the check is killed before anything re-protects it:
// from there on its peers would get bytes of a different execution, or of one nobody can vouch for. The
// recovery ends with a named failure, never a hang and never a job of unknown fidelity. It is the one
// place that kills a restored job (with refuse, as Run does for one whose peer job could not be restored); a
// resumed recovery (the agent restarted) calls it too.
func ReplayAndVerify(ctx context.Context, d Deps, j *Job) (string, error) {
	if j.stopKeeping != nil {
		defer j.stopKeeping()
	}
	gated := j.gateDone != nil
	detail, err := waitGate(j)
	if err == nil && j.finErr != nil {
		err = j.finErr
	}
	if err == nil {
		var rdetail string
		rdetail, err = waitReplay(ctx, d, j)
		detail += rdetail
	}
	if err == nil {
		var vdetail string
		vdetail, err = verifyResent(ctx, d, j)
		detail += "; " + vdetail
	}
	if gated && errors.Is(err, recvdigest.ErrNondeterministic) {
		// The order of its receive calls was kept and it still re-sent other bytes: say what else it
		// depends on, so that the operator does not look for a bug in the replay.
		err = fmt.Errorf("%w (its receive calls were replayed in the recorded order: it decides from something else, such as which messages had arrived when it checked, as MPI_Waitany and MPI_ANY_SOURCE do, or the clock; or a crash took the determinants of its last receives: docs/receive-order.md)", err)
	}
	if err != nil && ctx.Err() != nil {
		// The agent stops (its context ended), not the job: the job failed nothing yet. Killed, it would be
		// gone for the next agent, which resumes the recovery from its record and checks every byte.
		return detail, fmt.Errorf("replay not verified: the agent is stopping, the next one resumes it: %w", ctx.Err())
	}
	if err != nil {
		refuse(d, j, err)
	}
	return detail, err
}

// Refuse kills restored job j for err, as ReplayAndVerify does, for a resumed recovery that finds before the
// replay that the job cannot go on (the rest of its receive bytes could not be delivered).
func Refuse(d Deps, j *Job, err error) { refuse(d, j, err) }

// refuse kills restored job j for err, and resets the peers it left short.
func refuse(d Deps, j *Job, err error) {
	rollsBack := d.Jobs.RollsBack(j.ID) // the whole run rolls back, the peers included: nobody to reset
	short := abandon(d, j)
	d.Jobs.Kill(j.ID, err)
	if !rollsBack {
		resetPeers(d, j, short)
	}
}

// shortPeer is a peer that received more than an abandoned job re-sent: up to target on flow.
type shortPeer struct {
	flow   tcpflow.Tuple
	target uint32
}

// abandon lets go of a restored job that is about to be killed: the ACK clamp stops holding its flows'
// peer ACKs down (else the RST this host's TCP sends for the dead sockets would carry those lowered
// numbers, which the peers ignore). It returns the peers that received more than the job re-sent.
func abandon(d Deps, j *Job) []shortPeer {
	var short []shortPeer
	for _, c := range j.Plan.Conns {
		if c.Resend == 0 || slices.Contains(j.Replayed, c.Conn.Tuple) {
			continue // the peer has no byte the job did not send again: the job's own close reaches it
		}
		flow, target := c.Conn.Tuple, c.Conn.OutqSeq+c.Resend
		// Read before the clamp lets go of the flow: with a clamp, it is what knows how far the socket sent.
		sent, ok := d.Log.SentUpTo(flow)
		if d.Clamp != nil {
			d.Clamp.Release(flow)
		}
		if !ok || int32(sent-target) < 0 {
			short = append(short, shortPeer{flow, target})
		}
	}
	return short
}

// resetPeers sends each peer an abandoned job left short a RST at exactly what it received, so that it
// fails at once instead of waiting for bytes that will never come. It runs after the kill: a RST first
// could make the peer close before the job is dead, and the job then see the peer's reset and exit on its
// own instead of being killed (ci124). A resumed recovery without a network resets nobody.
func resetPeers(d Deps, j *Job, short []shortPeer) {
	n := netOf(d, j)
	if n == nil {
		return
	}
	for _, p := range short {
		if err := n.ResetPeer(p.flow, p.target); err != nil {
			d.Logger.Warn("could not reset a peer of the abandoned job: it may wait until its keepalive finds the connection dead", "job", j.ID, "conn", p.flow, "err", err)
		}
	}
}

// waitReplay waits until every restored connection has re-sent the bytes its peer already had: from then
// on the job produces new bytes, and the peers' TCP discarded the re-sent ones as duplicates. The restored
// socket's progress is read from Log.SentUpTo (the ACK clamp's state, or the sender-side log's).
func waitReplay(ctx context.Context, d Deps, j *Job) (string, error) {
	timeout := d.ReplayTimeout
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var total int64
	var clamped uint64
	for _, c := range j.Plan.Conns {
		if c.Resend == 0 {
			continue
		}
		total += int64(c.Resend)
		target := c.Conn.OutqSeq + c.Resend
		flow := c.Conn.Tuple
		if slices.Contains(j.Replayed, flow) {
			continue
		}
		for {
			sent, ok := d.Log.SentUpTo(flow)
			if ok && int32(sent-target) >= 0 {
				break
			}
			if state, running := d.Jobs.State(j.ID); !running {
				// Looked at again: it may have re-sent the rest and ended since the look above, and a job
				// that finished after its replay is checked like any other, not killed as one that fell short.
				if sent, ok := d.Log.SentUpTo(flow); ok && int32(sent-target) >= 0 {
					break
				}
				return "", fmt.Errorf("job %s ended (%s) before it re-sent what %s had", j.ID, state, c.Conn.Remote)
			}
			select {
			case <-ctx.Done():
				return "", fmt.Errorf("connection %s -> %s: the restored job did not re-send what its peer had received (up to sequence %d) within %s (failover.replay_timeout): it diverged from the execution its peers saw (it waits for a message they will never send) or is stuck", c.Conn.Local, c.Conn.Remote, target, timeout)
			case <-time.After(5 * time.Millisecond):
			}
		}
		if d.Clamp != nil {
			clamped += d.Clamp.Release(flow)
		}
		// Complete: an abandon after a failed check must neither release it again nor, the clamp no
		// longer knowing how far it sent, take its peer for one left short (ci124).
		j.Replayed = append(j.Replayed, flow)
	}
	return fmt.Sprintf("%d bytes re-sent and discarded by the peers; %d peer ACKs clamped", total, clamped), nil
}

// verifyResent checks every byte the restored job re-sent on each connection, as this host's log captured
// it, against the peer's record, and says which connection failed at a difference or at a byte it cannot
// check (ReplayAndVerify then kills the job).
//
// The check of a connection starts at the snapshot's write_seq, usually inside a block the receiver
// digested whole; the snapshot carries the CRC of that block's bytes before write_seq
// (ckpt.Conn.SentPrefix).
func verifyResent(ctx context.Context, d Deps, j *Job) (string, error) {
	var total uint64
	n := 0
	for _, c := range j.Plan.Conns {
		if c.Resend == 0 {
			continue
		}
		conn := c.Conn.Tuple
		from, to := c.Conn.OutqSeq, c.Conn.OutqSeq+c.Resend
		chk := j.Checks[conn]
		var err error
		if chk.Received == nil {
			why := chk.Missing
			if why == "" {
				why = "the peer's record of what it received was not fetched"
			}
			err = &recvdigest.UnverifiedError{Conn: conn, From: from, To: to, Reason: why}
		} else {
			var prefix recvdigest.Prefix
			if p := c.Conn.SentPrefix; p != nil {
				prefix = recvdigest.Prefix{Known: true, Len: p.Len, CRC: p.CRC}
			}
			var v uint64
			missing := false // once bytes failed to arrive in the log, do not wait again for each later piece
			// The peer's rcv_nxt counts the job's FIN if it had taken it in: the FIN is checked by where the
			// job sent it again, since no record of the peer holds it as a byte.
			fin, finOK := d.Log.FinSentAt(conn)
			v, err = recvdigest.VerifyFin(*chk.Received, from, to, fin, finOK, prefix, func(w io.Writer, seq, n uint32) error {
				if !missing {
					d.Log.WaitLogged(ctx, conn, seq, seq+n)
				}
				err := d.Log.ReadRange(ctx, w, conn, seq, n)
				missing = missing || err != nil
				return err
			})
			total += v
		}
		if err != nil {
			return fmt.Sprintf("re-sent bytes checked: %d, then connection %s failed the check", total, conn), err
		}
		n++
	}
	return fmt.Sprintf("re-sent bytes verified: all %d on %d connection(s)", total, n), nil
}
