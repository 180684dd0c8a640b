package clusterapi

import (
	"fmt"

	"github.com/ftkit/ftkit/intercept"
)

// DeterminantsRequest ships a run of one job's receive-order determinants from the host it runs on to its
// protector (an intercept.Batch; Packed is intercept.Pack's encoding).
type DeterminantsRequest struct {
	Job       string `json:"job"`
	Stream    uint64 `json:"stream"`
	First     uint64 `json:"first"`
	FromStart bool   `json:"from_start,omitempty"`
	Base      string `json:"base,omitempty"`
	Packed    []byte `json:"packed"`
	// Ack asks the protector to answer (on OpDeterminantStream2 and 3 only: detstream.go).
	Ack bool `json:"ack,omitempty"`
	// PackedLen is, on OpDeterminantStream3, how many bytes of Packed follow the line, which carries none.
	PackedLen int `json:"packed_len,omitempty"`
}

// Batch decodes the request, which comes from another host: the job id and base must be names an agent
// makes (checked by the caller, who knows the format), the determinants well formed and bounded.
func (r DeterminantsRequest) Batch() (intercept.Batch, error) {
	if r.Job == "" || len(r.Job) > 128 || len(r.Base) > 128 {
		return intercept.Batch{}, fmt.Errorf("determinants of job %.128q (base %.128q): bad name", r.Job, r.Base)
	}
	if r.PackedLen != 0 && r.PackedLen != len(r.Packed) {
		return intercept.Batch{}, fmt.Errorf("determinants of job %s: %d packed bytes announced, %d there", r.Job, r.PackedLen, len(r.Packed))
	}
	dets, err := intercept.Unpack(r.Packed)
	if err != nil {
		return intercept.Batch{}, fmt.Errorf("determinants of job %s: %w", r.Job, err)
	}
	return intercept.Batch{Job: r.Job, Stream: r.Stream, First: r.First, FromStart: r.FromStart, Base: r.Base, Dets: dets}, nil
}

// DeterminantsSinceRequest asks the holder of a snapshot for what its job consumed after the dump, from
// the From-th determinant on (a page at a time). Ran is the host the job last ran on from the snapshot
// (intercept.Store.SinceOn), "" for the one it was taken on. Set it only when it is another host: a server
// of an earlier version decodes requests strictly and refuses one that names it (bad-request).
type DeterminantsSinceRequest struct {
	Job      string `json:"job"`
	Snapshot string `json:"snapshot"`
	From     uint64 `json:"from"`
	Ran      string `json:"ran,omitempty"`
}

// DeterminantsSinceReply is one page: at most intercept.MaxBatch determinants, More if others follow.
type DeterminantsSinceReply struct {
	Packed []byte `json:"packed"`
	More   bool   `json:"more,omitempty"`
}
