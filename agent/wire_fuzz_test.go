package agent

import (
	"encoding/json"
	"github.com/ftkit/ftkit/failurelog"
	"github.com/ftkit/ftkit/tcpflow"
	"net/netip"
	"testing"
	"time"
)

// FuzzWireTimelines feeds arbitrary bytes to the agent's own decoders of peer bytes (package clusterapi
// fuzzes the protocol's): the failure timelines of a view, a recovery's stage and a status answer's
// stages, and the trim points it filters. Nothing may panic, and what is accepted stays within the bounds.
func FuzzWireTimelines(f *testing.F) {
	now := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	stage := Stage{Name: StageFetched, Job: "job-1", Host: "s1", Start: now, End: now.Add(time.Second)}
	for _, v := range []any{
		[]*Failure{{ID: "n3-1", Node: "n3", Stages: []Stage{stage}, Updated: now}},
		[]*Failure{nil},
		stage,
		[]Stage{stage, stage},
		[]TrimPoint{{Tuple: tcpflow.Tuple{Local: netip.MustParseAddrPort("10.77.0.1:5000"), Remote: netip.MustParseAddrPort("10.77.0.2:6000")}, Seq: 9}},
	} {
		b, _ := json.Marshal(v)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if fs, err := decodeFailures(data); err == nil {
			if len(fs) > failurelog.MaxFailures {
				t.Fatalf("%d failure timelines accepted", len(fs))
			}
			for _, x := range fs {
				if x != nil && (len(x.Stages) > maxWireStages || len(x.Jobs) > maxWireJobs) {
					t.Fatalf("a timeline of %d stages, %d jobs accepted", len(x.Stages), len(x.Jobs))
				}
			}
		}
		var s Stage
		json.Unmarshal(data, &s)
		var ss []Stage
		json.Unmarshal(data, &ss)
		var pts []TrimPoint
		if json.Unmarshal(data, &pts) == nil {
			own, foreign := ownTrimPoints(pts, "n2", func(ip netip.Addr) string {
				if ip == addrN2 {
					return "n2"
				}
				return ""
			})
			if len(own)+foreign != len(pts) {
				t.Fatalf("%d own + %d foreign of %d trim points", len(own), foreign, len(pts))
			}
		}
	})
}
