package clusterapi

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/tcpflow"
)

func testCoordinate() CoordinateRequest {
	uid := uint32(1000)
	return CoordinateRequest{Run: "run1", UID: &uid, Cut: "cut-20260501T120000", Phase: CoordCommit, Parts: []CutPart{{
		Job: "run1-n2-0a0b0c0d", Host: "n2", Snapshot: "20260501T120000.000Z-n2-000001",
		Conns: []ckpt.Conn{{Tuple: tcpflow.Tuple{Local: netip.MustParseAddrPort("10.77.0.2:5000"), Remote: netip.MustParseAddrPort("10.77.0.3:41000")}, InqSeq: 7, OutqSeq: 9, OutqLen: 2}},
	}}}
}

func TestCoordinateRequestValidate(t *testing.T) {
	part := testCoordinate().Parts[0]
	with := func(f func(*CoordinateRequest)) CoordinateRequest {
		r := testCoordinate()
		r.Parts = []CutPart{part}
		f(&r)
		return r
	}
	for _, tt := range []struct {
		name string
		req  CoordinateRequest
		want string // "" = valid
	}{
		{"valid", testCoordinate(), ""},
		{"list without parts", with(func(r *CoordinateRequest) { r.Phase, r.Parts = CoordList, nil }), ""},
		{"list of any user's jobs", with(func(r *CoordinateRequest) { r.Phase, r.Parts, r.UID = CoordList, nil, nil }), ""},
		{"a phase without its user", with(func(r *CoordinateRequest) { r.Phase, r.UID = CoordStop, nil }), "names no user"},
		{"restore on a spare", with(func(r *CoordinateRequest) { r.Parts[0].Target, r.Parts[0].Source = "n4", "n3" }), ""},
		{"run with a slash", with(func(r *CoordinateRequest) { r.Run = "../x" }), "run"},
		{"empty cut", with(func(r *CoordinateRequest) { r.Cut = "" }), "cut"},
		{"unknown phase", with(func(r *CoordinateRequest) { r.Phase = "shred" }), "phase"},
		{"bad snapshot id", with(func(r *CoordinateRequest) { r.Parts[0].Snapshot = "../../etc" }), "snapshot"},
		{"job with a slash", with(func(r *CoordinateRequest) { r.Parts[0].Job = "a/b" }), "job"},
		{"no host", with(func(r *CoordinateRequest) { r.Parts[0].Host = "" }), "host"},
		{"bad target", with(func(r *CoordinateRequest) { r.Parts[0].Target = "n 4" }), "part"},
		{"too many parts", with(func(r *CoordinateRequest) {
			for range MaxCutParts {
				r.Parts = append(r.Parts, part)
			}
		}), "at most"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.req.Validate()
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Fatalf("got %v, want an error naming %q", err, tt.want)
			}
		})
	}
}
