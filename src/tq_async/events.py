"""What ``client.watch()`` yields: the controller's changes as typed events.

Every event is a msgspec struct with ``seq`` (its place in the controller's event log) and
``kind`` (e.g. ``"rows_added"``, what ``watch(kinds=...)`` selects; `EVENT_KINDS`
lists them). ``msgspec.json.encode(event)`` prints one as JSON. See ``docs/watching.md``.
"""

from ._wire._events import EVENT_KINDS as EVENT_KINDS
from ._wire._events import AnyEvent as AnyEvent
from ._wire._events import ClusterSnapshot as ClusterSnapshot
from ._wire._events import ConsumptionReset as ConsumptionReset
from ._wire._events import Event as Event
from ._wire._events import FieldsProduced as FieldsProduced
from ._wire._events import LeaseAcked as LeaseAcked
from ._wire._events import LeaseExpired as LeaseExpired
from ._wire._events import LeaseGranted as LeaseGranted
from ._wire._events import PartitionCleared as PartitionCleared
from ._wire._events import PartitionCreated as PartitionCreated
from ._wire._events import PartitionRestored as PartitionRestored
from ._wire._events import PartitionSealed as PartitionSealed
from ._wire._events import PartitionSnapshot as PartitionSnapshot
from ._wire._events import Resync as Resync
from ._wire._events import RowsAdded as RowsAdded
from ._wire._events import RowsConsumed as RowsConsumed
from ._wire._events import RowsReleased as RowsReleased
from ._wire._events import RowsRemoved as RowsRemoved
from ._wire._events import TagsChanged as TagsChanged
from ._wire._events import UnitBack as UnitBack
from ._wire._events import UnitLost as UnitLost
from ._wire._events import UnitSuspended as UnitSuspended

__all__ = [
    "EVENT_KINDS",
    "AnyEvent",
    "ClusterSnapshot",
    "ConsumptionReset",
    "Event",
    "FieldsProduced",
    "LeaseAcked",
    "LeaseExpired",
    "LeaseGranted",
    "PartitionCleared",
    "PartitionCreated",
    "PartitionRestored",
    "PartitionSealed",
    "PartitionSnapshot",
    "Resync",
    "RowsAdded",
    "RowsConsumed",
    "RowsReleased",
    "RowsRemoved",
    "TagsChanged",
    "UnitBack",
    "UnitLost",
    "UnitSuspended",
]
