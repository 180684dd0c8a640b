package clusterapi

import (
	"context"
	"fmt"
)

// OpSignal passes a signal a local caller of the asking member (ftwrap's Ctrl-C, ftctl kill) sent to a
// job that left the asker's host, migrated or restored elsewhere, to the host it went to: the caller's
// only handle on the job is its own host's agent. UID is the caller's, from SO_PEERCRED on the asking
// member, believed as OpStartJob's is; the server signals the job only if UID owns it (or is root). An
// agent without the operation refuses it as unknown: the signal is lost as it was before.

// SignalRequest is OpSignal's request.
type SignalRequest struct {
	Job    string `json:"job"`
	UID    uint32 `json:"uid"`
	Signal int    `json:"signal"`
}

// Validate refuses a job id that is not one and a signal outside 1 to 64 (the local API's bounds).
func (r SignalRequest) Validate() error {
	if !startJobIDRE.MatchString(r.Job) {
		return fmt.Errorf("signal: job id %.80q", r.Job)
	}
	if r.Signal <= 0 || r.Signal > 64 {
		return fmt.Errorf("signal: %d is not a signal number from 1 to 64", r.Signal)
	}
	return nil
}

// Signal asks peer to send req.Signal to its copy of job req.Job for a local caller of this agent.
func (c *Client) Signal(ctx context.Context, peer string, req SignalRequest) error {
	if err := req.Validate(); err != nil {
		return err
	}
	_, err := call[struct{}](c, ctx, peer, OpSignal, c.msg(), req)
	return err
}
